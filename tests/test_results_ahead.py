"""Asking ahead: the results client requests the next page while it writes one, and a result is
still marked delivered only once the file holding it is fsynced (invariant 12).

The protocol (collector/delivery_client.py, docs/completion.md "Delivery"): a
FETCH names the pages the client holds (`hold`: received, not acknowledged);
completion leaves their results out of the next page and keeps them
outstanding; the ack of a page goes with the first FETCH after its fsync.
Held here: completion's side in-process (a real stage on a fake clock), the
client's bookkeeping, and a real client process SIGKILLed with two pages out
(one held, one requested), then run again: each line once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import test_dispatch_pipeline
from broker import REPO
from conftest import wait_for
from test_completion_stage import Harness, submit
from test_completion_stage import settings as settings  # the fixture
from test_dispatch_pipeline import (
    assert_each_once,
    fetch,
    finished,
    job_info,
    stop_and_check,
    submit_job,
)

from collector.delivery_client import Delivery
from pipeline.transport import wire

MT = wire.MessageType
broker = test_dispatch_pipeline.broker  # the fixture: a real broker


def rows(page: wire.Message) -> list[int]:
    return page.arrays["index"].tolist()


def test_a_held_page_is_left_out_of_the_next_and_acknowledged_later(settings):
    """Before `hold`, a FETCH without the ack of the page out meant the page was lost: the
    next page was the same results again, so a client could not ask ahead."""
    submit(settings, "job-h", stored=0, rejected=10)  # ten error results, stored at once
    h = Harness(settings)
    try:
        h.step()
        h.step(0.01)
        first = h.ask(MT.FETCH, {"job": "job-h", "limit": 3})
        a = first.meta["page"]
        assert first.meta["ahead"] is True and rows(first) == [0, 1, 2]
        second = h.ask(MT.FETCH, {"job": "job-h", "ack": 0, "hold": [a], "limit": 3})
        b = second.meta["page"]
        assert rows(second) == [3, 4, 5]  # the held page's results are left out
        assert second.meta["undelivered"] == 10  # holding marks nothing
        third = h.ask(MT.FETCH, {"job": "job-h", "ack": a, "hold": [b], "limit": 3})
        assert rows(third) == [6, 7, 8] and third.meta["undelivered"] == 7
        # a client that restarted holds nothing: the pages out are forgotten, sent again
        again = h.ask(MT.FETCH, {"job": "job-h", "ack": 0, "limit": 3})
        assert rows(again) == [3, 4, 5] and again.meta["undelivered"] == 7
        held, seen, ack = again.meta["page"], rows(again), 0
        while True:  # as the client: ask ahead holding a page, ack it with the FETCH after
            page = h.ask(MT.FETCH, {"job": "job-h", "ack": ack, "hold": [held], "limit": 3})
            ack = held  # written and fsynced meanwhile
            if not rows(page):
                break
            seen, held = seen + rows(page), page.meta["page"]
        assert sorted(seen) == list(range(3, 10))  # each once
        last = h.ask(MT.FETCH, {"job": "job-h", "ack": ack, "limit": 3})
        assert rows(last) == [] and last.meta["undelivered"] == 0
        bad = h.ask(MT.FETCH, {"job": "job-h", "hold": 3})
        assert bad.type == MT.ERROR and "hold is 3" in bad.meta["reason"]
    finally:
        h.close()


def test_the_client_holds_a_page_until_durable_and_acks_it_with_the_next_fetch():
    d = Delivery("j", {"limit": 5})
    assert d.counts({"req": d.ask(0.0)["req"], "page": 1, "ahead": True})
    ahead = d.ahead({"page": 1, "ahead": True}, 0.1)  # page 1 arrived, not written yet
    assert ahead == {"job": "j", "ack": 0, "req": 2, "limit": 5, "hold": [1]}
    d.written({"page": 1})
    d.durable(0.2)  # fsynced before the answer to the FETCH ahead is read
    assert d.counts({"req": 2, "page": 2, "ahead": True})
    assert d.ack == 1  # that FETCH did not carry this ack: the next one does
    assert d.ahead({"page": 2, "ahead": True}, 0.3)["ack"] == 1
    assert d.ahead({"page": 3}, 0.4) is None  # an older completion: one page at a time
    everything = Delivery("j", {"all": True})
    everything.counts({"req": everything.ask(0.0)["req"]})
    assert everything.ahead({"page": 0, "cursors": [[1, 9]]}, 0.1)["cursors"] == [[1, 9]]


def test_pages_fsynced_on_a_thread_are_held_until_durable_and_acked_one_per_fetch():
    d = Delivery("j")
    d.counts({"req": d.ask(0.0)["req"]})
    first = d.ahead({"page": 1, "ahead": True}, 0.1)
    assert (first["ack"], first["hold"]) == (0, [1])
    d.counts({"req": first["req"]})
    second = d.ahead({"page": 2, "ahead": True}, 0.2)  # page 1's fsync still runs
    assert (second["ack"], second["hold"]) == (0, [1, 2])
    d.durable_page(1, 0.3)
    d.counts({"req": second["req"]})
    third = d.ahead({"page": 3, "ahead": True}, 0.4)
    assert (third["ack"], third["hold"]) == (1, [2, 3])


KILLED_CLIENT = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from collector.delivery.result_file import ResultFile
    from collector.delivery_client import Delivery
    from collector.results_client import ResultsClient

    address, job, out, err, when, state = sys.argv[1:]
    deliveries, count = [], [0]
    ahead, write_page, durable_page = Delivery.ahead, ResultFile._write_page, Delivery.durable_page

    def kill_at(nth):
        count[0] += 1
        if count[0] == nth:
            d = deliveries[-1]
            Path(state).write_text(json.dumps({"held": d.held, "asked": d.sent_at is not None}))
            os.kill(os.getpid(), signal.SIGKILL)

    def asked(self, page, now):
        deliveries.append(self)
        return ahead(self, page, now)

    def write(self, data, keys, given):  # under write_page and write_custom_ids
        if when == "write" and self.path == Path(out):
            kill_at(3)  # page 3: page 2 is fsynced on a thread, page 4 asked for
        return write_page(self, data, keys, given)

    def durable(self, page, now):
        durable_page(self, page, now)
        if when == "durable" and page:
            kill_at(2)  # page 2 fsynced, its ack not sent; page 3 written, page 4 asked for

    Delivery.ahead, ResultFile._write_page, Delivery.durable_page = asked, write, durable
    with ResultsClient(address, 10.0) as client:
        client.fetch(job, out, err, page_items=300)
    """
)


def test_a_client_killed_with_two_pages_out_then_run_again_writes_each_line_once(tmp_path, broker):
    """SIGKILL with pages out: written (its fsync running on a thread, or done and not yet
    acknowledged) and the next asked for. Nothing of them was marked delivered, so the run
    again writes every line, each once. Fails without asking ahead (nothing is held)."""
    b = broker(workers=2)
    n = 2000
    kills = {"write": 2, "durable": 1}  # where the client dies -> pages it holds then
    for job in kills:
        submit_job(b, tmp_path, n, job)
    wait_for(lambda: all(finished(b, job) for job in kills), "both jobs", timeout_s=120)
    for job, holding in kills.items():
        out, state = tmp_path / f"{job}-out.jsonl", tmp_path / f"{job}.state"
        err = f"{out}.errors.jsonl"
        args = [b.settings.completion.bind, job, str(out), err, job, str(state)]
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_CLIENT, *args],
            cwd=REPO,
            timeout=120,
            text=True,
            capture_output=True,
        )
        assert killed.returncode == -9, killed.stderr
        held = json.loads(state.read_text())
        assert len(held["held"]) == holding and held["asked"], held  # and one asked for
        left = n - 300  # page 1 acknowledged (by the FETCH that asked for page 4), no other
        wait_for(lambda j=job, k=left: job_info(b, j)["undelivered"] == k, "the ack")
        rerun = fetch(b, job, out, timeout_s=60)  # liveness: done well within a minute
        assert rerun.returncode == 0, rerun.stderr
        assert_each_once(out, n)
        assert job_info(b, job)["undelivered"] == 0
    stop_and_check(b)
