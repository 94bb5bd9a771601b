"""Every client goes through one request/retry loop and says "broker unavailable" one way
(pipeline/transport/broker_client.py, pipeline/core/errors.py BrokerUnavailableError), in-process."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from conftest import wait_for

from collector.results_client import DispatchClient, ResultsClient
from collector.vectors.client import VectorsClient
from ingest.submit_client import Producer
from pipeline.core.errors import BrokerUnavailableError, FabricError
from pipeline.transport import wire
from pipeline.transport.broker_client import MAX_BACKOFF_S, BrokerClient, backoff_s

MT = wire.MessageType


def _ask(make, call):
    def ask(address):
        with make(address) as client:
            return call(client)

    return ask


CLIENTS = [
    pytest.param(
        _ask(lambda a: Producer(a, timeout_s=0.3), lambda c: c.job_status("j")), id="submit"
    ),
    pytest.param(
        _ask(lambda a: ResultsClient(a, 0.3, attempts=2), lambda c: c.job_status("j")), id="results"
    ),
    pytest.param(
        _ask(lambda a: DispatchClient(a, 0.3, attempts=2), lambda c: c.broker_status()),
        id="dispatch",
    ),
    pytest.param(
        _ask(lambda a: VectorsClient(a, 0.3, attempts=2), lambda c: c.stats()), id="vectors"
    ),
]


class SilentBroker:
    """A ROUTER that takes requests and answers with `reply(message)`: one (type, meta[,
    arrays]) answer, a list of them, or None (silence)."""

    def __init__(self, tmp_path, reply=lambda m: None) -> None:
        self.address = f"ipc://{tmp_path}/broker.sock"
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.address)
        self.reply = reply
        self.heard = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            message = wire.recv(self.router, 0)
            self.heard += 1
            answers = self.reply(message) or []
            for answer in [answers] if isinstance(answers, tuple) else answers:
                wire.send(self.router, *answer, route=message.route)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.router.close(0)
        self.context.term()


@pytest.fixture
def silent(tmp_path):
    broker = SilentBroker(tmp_path)
    yield broker
    broker.close()


@pytest.mark.parametrize("ask", CLIENTS)
def test_every_client_says_broker_unavailable_one_way_when_nothing_listens(tmp_path, ask):
    with pytest.raises(BrokerUnavailableError, match=r"nothing\.sock"):
        ask(f"ipc://{tmp_path}/nothing.sock")


@pytest.mark.parametrize("ask", CLIENTS)
def test_every_client_tries_again_then_says_broker_unavailable_when_the_broker_is_silent(
    silent, ask
):
    with pytest.raises(BrokerUnavailableError, match="no answer from the broker at"):
        ask(silent.address)
    assert silent.heard >= 2  # tried again, on a fresh socket


def test_an_error_answer_is_the_brokers_word_and_not_retried(tmp_path):
    broker = SilentBroker(tmp_path, reply=lambda m: (MT.ERROR, {"reason": "no job 'j'"}))
    try:
        with (
            BrokerClient(broker.address, 2.0, attempts=3) as client,
            pytest.raises(FabricError, match="says: no job 'j'") as raised,
        ):
            client.request(MT.JOB_STATUS, {"job": "j"}, MT.JOB_INFO)
        assert not isinstance(raised.value, BrokerUnavailableError)
        assert broker.heard == 1
    finally:
        broker.close()


def test_backoff_doubles_from_a_fifth_of_a_second_to_five_with_jitter():
    assert [backoff_s(t, jitter=False) for t in (1, 2, 3, 6, 20)] == [0.2, 0.4, 0.8, 5.0, 5.0]
    for tries in range(1, 10):
        base = backoff_s(tries, jitter=False)
        assert 0.5 * base <= backoff_s(tries) <= 1.5 * base <= 1.5 * MAX_BACKOFF_S


def test_a_chunk_lost_with_a_dead_front_is_sent_again_as_soon_as_a_new_one_answers(tmp_path):
    """The front dies holding a chunk it never answered; a new front binds the same address:
    the producer sends the chunk again as soon as it is connected to the new one
    (pipeline/transport/reconnect_watch.py), not after its 30 s answer timeout."""
    import numpy as np

    def first(message):
        if message.type == MT.JOB_STATUS:
            return (MT.JOB_INFO, {"job": "j", "exists": False})
        return None  # the chunk: taken, never answered

    def second(message):
        assert message.type == MT.SUBMIT_CHUNK
        meta = {"job": "j", "chunk": message.meta["chunk"], "stored": 3, "state": "queued"}
        return (MT.CHUNK_ACK, meta)

    old = SilentBroker(tmp_path, reply=first)
    done: dict = {}
    with Producer(old.address, timeout_s=30.0) as producer:
        rows = np.arange(1, 7, dtype=np.uint32).reshape(3, 2)
        sending = threading.Thread(
            target=lambda: done.update(report=producer.submit_tokens("j", "m", rows, chunk_lines=3))
        )
        sending.start()
        wait_for(lambda: old.heard == 2, "the status request and the chunk", timeout_s=10)
        old.close()  # the front dies with the chunk
        new = SilentBroker(tmp_path, reply=second)
        try:
            started = time.monotonic()
            sending.join(20)
            took = time.monotonic() - started
        finally:
            new.close()
    assert not sending.is_alive() and done["report"].stored == 3
    assert new.heard == 1 and took < 5  # at the reconnect, far under the 30 s timeout
