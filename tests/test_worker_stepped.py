"""A worker session (gpu/worker/session.py) stepped on a fake clock against a broker the test plays.

The worker is the real `Worker`, with its engine thread and its DEALER
sockets; dispatch's worker port and the heartbeat endpoint are ROUTERs the
test binds on loopback (ports the OS picks) and plays one message at a time.
Only the clock is the test's: each `step(now)` is given `Session.now`, which
moves when the test moves it. Waits have deadlines and are for sockets only
(a connection, a message's arrival, an engine's outcome waking the worker's
poll), never sleeps.

ZeroMQ's slow joiner: the worker's sockets queue nothing for a peer not yet
connected (IMMEDIATE), so a HELLO sent before the TCP connect completes is
lost. A session waits for its sockets to be writable (connected) before its
first step.

Every test ends with `Session.stop`, whose BYE is the last message: the
broker's port is first in, first out, so a message the worker sent that the
test did not expect (a HELLO or REPORT a tick early, a resend after the ack)
comes before the BYE and fails the test.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from gpu.engines.base import EngineBatch, EngineResult
from gpu.engines.echo import EchoEngine
from gpu.work_protocol import ITEM_DTYPE
from gpu.worker.options import WorkerOptions
from gpu.worker.registration import FIRST_HELLO_S, HELLO_MAX_S
from gpu.worker.session import RESEND_S, Worker
from pipeline.core import exitcodes
from pipeline.store.segment_format import SLOT_HEADER_WORDS
from pipeline.transport import wire

MT = wire.MessageType
T0 = 1000.0  # the fake clock's start: far from the host's monotonic clock, so a real read shows
TICK = 0.001
WAIT_MS = 5000  # the longest wait for a socket: a connection, a message, an engine's outcome
LANE = 4
EPOCH = 3


class GateEngine(EchoEngine):
    """The echo engine, each batch held until the test opens `go`; `started` says one began."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.started = threading.Event()
        self.batches = 0

    def infer(self, batch: EngineBatch) -> EngineResult:
        self.batches += 1
        self.started.set()
        self.go.wait(60)  # opened by the test, or at its end
        return super().infer(batch)


class PlayedBroker:
    """Dispatch's worker port and the heartbeat endpoint, played by the test."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.port = wire.open_socket(self.context, zmq.ROUTER, bind="tcp://127.0.0.1:*")
        self.beat = wire.open_socket(self.context, zmq.ROUTER, bind="tcp://127.0.0.1:*")
        self.route: tuple[bytes, ...] = ()
        self.beat_route: tuple[bytes, ...] = ()

    @staticmethod
    def address(socket: zmq.Socket) -> str:
        return socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def arrived(self) -> bool:
        return bool(self.port.poll(0, zmq.POLLIN))

    def take(self, kind: MT) -> wire.Message:
        """The worker's next message, which must be `kind` (waited for WAIT_MS at most)."""
        message = wire.recv(self.port, WAIT_MS)
        assert message is not None, f"no {kind.name} from the worker within {WAIT_MS} ms"
        assert message.type == kind, f"{kind.name} expected, the worker sent {message}"
        self.route = message.route
        return message

    def send(self, kind: MT, meta: dict, arrays: dict | None = None) -> None:
        wire.send(self.port, kind, meta, arrays, route=self.route)

    def welcome(self, report_s: float, known: list[int] | None = None, epoch: int = EPOCH) -> None:
        meta = {"epoch": epoch, "lease_s": 6.0, "report_s": report_s}
        self.send(MT.WELCOME, meta, {"known": np.array(known or [], np.uint8)})

    def work(self, batch_id: int, slots: list[int]) -> None:
        """WORK for batch `batch_id`: one item per slot of segment 1, one token each."""
        items = np.zeros(len(slots), ITEM_DTYPE)
        items["segment"], items["slot"], items["seq"] = 1, slots, slots
        words = np.zeros((len(slots), SLOT_HEADER_WORDS + LANE), np.uint32)
        words[:, SLOT_HEADER_WORDS] = np.array(slots) + 100
        meta = {
            "batch_id": batch_id,
            "segment": 1,
            "lane": LANE,
            "task": "embed",
            "max_tokens": 4,
            "token": f"token-{batch_id}",
        }
        arrays = {"items": items, "lengths": np.ones(len(slots), np.uint32), "slots": words}
        self.send(MT.WORK, meta, arrays)

    def ping(self) -> None:
        """The worker's next PING on the heartbeat endpoint (waited for WAIT_MS at most)."""
        message = wire.recv(self.beat, WAIT_MS)
        assert message is not None and message.type == MT.PING, message
        self.beat_route = message.route

    def pong(self, epoch: int) -> None:
        wire.send(self.beat, MT.PONG, {"epoch": epoch}, route=self.beat_route)

    def close(self) -> None:
        self.port.close(0)
        self.beat.close(0)
        self.context.term()


class Session:
    """A real Worker connected to the played broker, stepped at `self.now`."""

    def __init__(self, broker: PlayedBroker, engine, heartbeat: bool = False, **options) -> None:
        self.broker = broker
        self.engine = engine
        beat = broker.address(broker.beat) if heartbeat else None
        address = broker.address(broker.port)
        self.worker = Worker(WorkerOptions(address, "echo", heartbeat=beat, **options), engine)
        self.worker.registration.jitter = lambda: 0.5  # each hello exactly one backoff apart
        self.worker.open()
        connection = self.worker.connection
        for socket in (connection.socket, connection.pinger):  # the slow joiner: wait for
            if socket is not None:  # the connection, or the first HELLO or PING is lost
                assert socket.poll(WAIT_MS, zmq.POLLOUT), "the worker did not connect"
        self.now = T0

    def step(self, at: float | None = None) -> None:
        """One step at `at` (default: `now`, unchanged), waiting for nothing."""
        if at is not None:
            self.now = at
        self.worker.step(self.now, 0)

    def until(self, condition, what: str) -> None:
        """Step at `now` (each step waits on the worker's sockets and its engine's outcomes,
        50 ms at most) until `condition()`; fail after WAIT_MS."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while not condition():
            assert time.monotonic() < deadline, f"the worker never got to: {what}"
            self.worker.step(self.now, 50)

    def sent(self, kind: MT) -> wire.Message:
        """Step at `now` until the worker has sent something; it must be `kind`."""
        self.until(self.broker.arrived, f"send {kind.name}")
        return self.broker.take(kind)

    def register(self, report_s: float) -> None:
        """HELLO, WELCOME; then the worker asks for work and reports at once."""
        self.step()
        self.broker.take(MT.WORKER_HELLO)
        self.broker.welcome(report_s)
        self.until(lambda: self.worker.registration.registered, "take the WELCOME")
        self.step()
        self.broker.take(MT.WORK_REQUEST)
        self.broker.take(MT.REPORT)

    def pause_asking(self) -> None:
        """NO_WORK for longer than any test runs on the fake clock: no more WORK_REQUEST."""
        self.broker.send(MT.NO_WORK, {"retry_ms": 10**7})
        self.until(lambda: not self.worker.asking, "take the NO_WORK")

    def stop(self) -> None:
        """Drain with nothing running, and say BYE: the last message the worker sends."""
        self.worker.begin_drain()
        assert self.worker.drained
        self.worker.end_drain()
        self.broker.take(MT.BYE)

    def close(self) -> None:
        go = getattr(self.engine, "go", None)
        if go is not None:
            go.set()
        self.worker.close()


@pytest.fixture
def broker():
    played = PlayedBroker()
    try:
        yield played
    finally:
        played.close()


@pytest.fixture
def session(broker):
    sessions: list[Session] = []

    def make(engine, **options) -> Session:
        sessions.append(Session(broker, engine, **options))
        return sessions[-1]

    try:
        yield make
    finally:
        for s in sessions:
            s.close()


def test_hello_is_sent_again_at_its_doubling_backoff_until_welcome_then_reports_every_report_s(
    broker, session
):
    s = session(EchoEngine())
    s.step()
    hello = broker.take(MT.WORKER_HELLO)
    assert hello.meta["model"] == "echo" and hello.meta["tokens"] == []
    backoff_s = FIRST_HELLO_S
    for _ in range(5):  # no WELCOME: again after 0.2, 0.4, 0.8 s, then every HELLO_MAX_S
        due = s.now + backoff_s
        assert s.worker.registration.next_try == due
        s.step(due - TICK)
        assert s.worker.registration.next_try == due  # not said a tick before
        s.step(due)
        assert broker.take(MT.WORKER_HELLO).meta["session"] == hello.meta["session"]
        backoff_s = min(HELLO_MAX_S, backoff_s * 2)
    assert backoff_s == HELLO_MAX_S

    broker.welcome(report_s=2.0)
    s.until(lambda: s.worker.registration.registered, "take the WELCOME")
    s.step(s.now + 0.5)
    broker.take(MT.WORK_REQUEST)
    report = broker.take(MT.REPORT)  # at once once registered
    assert report.meta["queued"] == [] and len(report.arrays["held"]) == 0
    s.pause_asking()
    reported = s.now
    for _ in range(3):
        s.step(reported + 2.0 - TICK)
        s.step(reported + 2.0)
        broker.take(MT.REPORT)
        reported += 2.0
    s.step(reported + 2.0 - TICK)
    s.stop()  # BYE next: no HELLO after the WELCOME, no REPORT a tick early


def test_a_hung_batch_keeps_being_reported_until_the_watchdog_ends_the_worker_at_batch_timeout_s(
    broker, session
):
    engine = GateEngine()
    s = session(engine, batch_timeout_s=30.0, prefetch=1)
    s.register(report_s=10.0)
    broker.work(1, [0, 1])
    s.until(lambda: 1 in s.worker.held, "take batch 1")
    assert engine.started.wait(WAIT_MS / 1000)  # and the engine hangs on it
    s.step(T0 + 1)  # the watchdog's first look at the running batch
    s.step(T0 + 10)
    report = broker.take(MT.REPORT)  # its leases are renewed: only the worker can tell
    assert report.arrays["held"]["slot"].tolist() == [0, 1] and report.meta["queued"] == []
    s.step(T0 + 1 + 30.0 - TICK)
    assert s.worker.exit_code is None
    broker.take(MT.REPORT)  # due at T0 + 20
    s.step(T0 + 1 + 30.0)
    assert s.worker.exit_code == exitcodes.FAILED and "hung" in s.worker.broken
    back = broker.take(MT.HAND_BACK)
    assert back.meta["count_attempt"] is True and "batch_timeout_s = 30" in back.meta["reason"]
    assert back.arrays["items"]["slot"].tolist() == [0, 1]
    broker.take(MT.BYE)
    assert not s.worker.held


def test_a_heartbeat_pings_every_report_s_and_a_new_epoch_makes_the_worker_register_again(
    broker, session
):
    s = session(EchoEngine(), heartbeat=True)
    s.register(report_s=3.0)  # at T0: the first PING went with the first HELLO
    broker.ping()
    s.pause_asking()
    first_ping = s.worker.registration.next_ping
    assert first_ping == T0 + 1.0  # the report_s before WELCOME
    s.step(first_ping - TICK)
    assert s.worker.registration.next_ping == first_ping  # no ping a tick before
    s.step(first_ping)
    broker.ping()
    assert s.worker.registration.next_ping == first_ping + 3.0  # WELCOME's report_s since
    broker.pong(EPOCH)  # the same broker life: nothing to do
    assert s.worker.connection.pinger.poll(WAIT_MS, zmq.POLLIN)
    s.step()
    assert s.worker.registration.registered
    s.step(first_ping + 3.0)
    broker.ping()
    broker.take(MT.REPORT)  # due since T0 + 3.0
    broker.pong(EPOCH + 1)  # the broker restarted
    assert s.worker.connection.pinger.poll(WAIT_MS, zmq.POLLIN)
    s.step()
    assert not s.worker.registration.registered
    s.step()  # registering again at once, not after a backoff
    assert broker.take(MT.WORKER_HELLO).meta["epoch"] == EPOCH
    broker.welcome(report_s=3.0, epoch=EPOCH + 1)
    s.until(lambda: s.worker.registration.registered, "take the second WELCOME")
    assert s.worker.registration.epoch == EPOCH + 1
    s.stop()  # the pause holds: no WORK_REQUEST, and REPORT is not due


def test_results_are_sent_again_every_resend_s_and_after_re_registering_until_acknowledged(
    broker, session
):
    s = session(EchoEngine(), prefetch=1)
    s.register(report_s=1000.0)
    broker.work(1, [5, 6])
    results = s.sent(MT.RESULTS)
    assert results.meta["result_id"] == 1 and results.meta["resent"] is False
    assert results.meta["token"] == "token-1" and results.arrays["items"]["slot"].tolist() == [5, 6]
    s.step()
    broker.take(MT.WORK_REQUEST)  # its slot is free
    s.pause_asking()
    sent_at = s.now
    s.step(sent_at + RESEND_S)  # unacknowledged RESEND_S: not yet
    assert s.worker.held[1].sent_at == sent_at
    s.step(sent_at + RESEND_S + TICK)
    again = broker.take(MT.RESULTS)
    assert again.meta["result_id"] == 1 and again.meta["resent"] is True

    broker.send(MT.UNKNOWN_SESSION, {"session": results.meta["session"]})  # a restarted broker
    s.until(lambda: not s.worker.registration.registered, "take UNKNOWN_SESSION")
    s.step()
    hello = broker.take(MT.WORKER_HELLO)  # claims the batch with its work token
    assert hello.meta["tokens"] == [[1, "token-1", 2]]
    assert hello.arrays["held"]["slot"].tolist() == [5, 6]
    broker.welcome(report_s=1000.0, known=[1, 1])
    s.until(lambda: s.worker.registration.registered, "take the WELCOME")
    assert broker.take(MT.RESULTS).meta["resent"] is True  # at once on WELCOME

    broker.send(MT.RESULTS_ACK, {"result_ids": [1]})
    s.until(lambda: not s.worker.held, "take the RESULTS_ACK")
    assert s.worker.completed == 2
    s.step(s.now + 3 * RESEND_S)
    s.stop()  # BYE next: nothing resent after the acknowledgement


def test_a_drain_hands_back_the_queued_batch_finishes_the_running_one_and_says_bye(broker, session):
    engine = GateEngine()
    s = session(engine, prefetch=2)
    s.register(report_s=1000.0)
    broker.work(1, [0, 1])
    s.until(lambda: 1 in s.worker.held, "take batch 1")
    broker.take(MT.WORK_REQUEST)  # room for one more
    broker.work(2, [2, 3])
    s.until(lambda: len(s.worker.held) == 2 and engine.started.is_set(), "hold both batches")
    s.step()

    s.worker.begin_drain()  # SIGTERM
    back = broker.take(MT.HAND_BACK)  # the queued batch, at once, without an attempt
    assert back.meta["count_attempt"] is False
    assert back.arrays["items"]["slot"].tolist() == [2, 3]
    s.step(s.now + 1.0)
    assert not s.worker.drained  # batch 1 still runs
    engine.go.set()
    results = s.sent(MT.RESULTS)  # it finishes; no WORK_REQUEST while draining
    assert results.arrays["items"]["slot"].tolist() == [0, 1]
    s.step(s.now + 1.0)
    assert not s.worker.drained  # its results are not acknowledged yet
    broker.send(MT.RESULTS_ACK, {"result_ids": [results.meta["result_id"]]})
    s.until(lambda: s.worker.drained, "take the RESULTS_ACK")
    s.worker.end_drain()
    broker.take(MT.BYE)
    assert engine.batches == 1  # the engine skipped the batch handed back
