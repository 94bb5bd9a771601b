"""The one delivery protocol (collector/delivery_client.py) that the results command and the
vector sink share: one FETCH in flight, the `req` echo, acknowledgement only once durable."""

from __future__ import annotations

import orjson
from test_broker_client import SilentBroker
from test_vector_sink import page

from collector.delivery_client import Delivery
from collector.results_client import ResultsClient
from pipeline.transport import wire

MT = wire.MessageType


def test_one_fetch_in_flight_a_resend_drops_the_older_answer_and_an_ack_waits_for_durable():
    d = Delivery("j", {"limit": 5}, answer_timeout_s=10.0)
    first = d.ask(0.0)
    assert first == {"job": "j", "ack": 0, "req": 1, "limit": 5}
    assert d.ask(9.0) is None  # its answer may still come
    second = d.ask(10.0)  # no answer in time: sent again, as a new request
    assert second["req"] == 2
    assert not d.counts({"req": 1, "page": 3})  # the answer to the first crossed the resend
    assert d.counts({"req": 2, "page": 3})
    assert not d.counts({"req": 2, "page": 3})  # answered already
    d.written({"page": 3})
    assert d.ask(11.0) is None  # not durable yet: nothing is acknowledged, nothing asked
    d.durable(12.0)
    assert d.ask(12.0) == {"job": "j", "ack": 3, "req": 3, "limit": 5}
    assert d.counts({"req": 3})
    d.idle(13.0, 0.25)
    assert d.ask(13.1) is None and d.ask(13.25)["ack"] == 0


def test_a_delivery_ends_on_an_empty_page_of_a_terminal_job_with_nothing_left():
    d = Delivery("j")
    assert not d.done({"state": "completed", "undelivered": 0}, rows=1)
    assert not d.done({"state": "in_progress", "undelivered": 0}, rows=0)
    assert not d.done({"state": "cancelled", "undelivered": 2}, rows=0)
    assert d.done({"state": "expired", "undelivered": 0}, rows=0)
    assert Delivery("j", {"all": True}).done({"state": "completed", "undelivered": 2}, rows=0)


def test_the_results_client_drops_a_page_that_answers_an_older_request(tmp_path):
    """Before one delivery client, only the vector sink checked the `req` echo: the results
    client wrote whatever RESULT_PAGE came first, an answer to an older request included."""

    def completion(message):
        meta = message.meta
        req = meta.get("req", 0)  # echoed as completion does
        if meta["ack"]:  # the page is acknowledged: the job is done
            done = page([], [], page_id=2, req=req, state="completed", undelivered=0, shapes={})
            return [(MT.RESULT_PAGE, *done)]
        stale = page([5], [[5.0] * 4], page_id=9, req=req - 1, shapes={})
        current = page([0], [[1.0] * 4], page_id=1, req=req, shapes={})
        return [(MT.RESULT_PAGE, *stale), (MT.RESULT_PAGE, *current)]

    broker = SilentBroker(tmp_path, reply=completion)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    try:
        with ResultsClient(broker.address, 5.0, attempts=2) as client:
            report = client.fetch("j", str(out), str(err))
    finally:
        broker.close()
    lines = [orjson.loads(x) for f in (out, err) for x in f.read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == ["c0"]  # never the stale page's c5
    assert report.written + report.errors == 1 and report.pages == 1
