"""A real TokenizerStage driven in-process, one `step(now)` at a time, on a fake clock.

Its sockets are real (the front's ends: TOKENIZE in, TOKENIZED back), its
router ring is real shared memory that the test reads as the router would;
only the clock is the test's. A chunk that finds the ring full waits in the
stage, tried again at each step, until there is room or `now` passes the
chunk's deadline.
"""

from __future__ import annotations

import pytest
import zmq
from broker import write_config, write_jsonl
from conftest import wait_for

from config import load_settings
from config.stage_settings import stage_settings
from ingest.batch_input import iter_batch_input
from ingest.chunk_wire import chunk_to_wire
from ingest.tokenizer_stage import TokenizerStage
from pipeline.store.datadir import DataDir
from pipeline.transport import wire
from pipeline.transport.ring import Ring
from pipeline.transport.ring_records import read_items
from pipeline.transport.topology import internal_address, rings_from

MT = wire.MessageType
T0 = 1000.0  # the test's clock: far from the host's monotonic clock, so a real read shows
TIMEOUT_S = 5.0


class Harness:
    def __init__(self, tmp_path, ring_bytes: int) -> None:
        self.tmp_path = tmp_path
        self.settings = load_settings(write_config(tmp_path))
        DataDir(self.settings.data_path).ensure()
        (self.spec,) = rings_from(self.settings, "tokenizer-0")
        self.ring = Ring.create(self.spec.name, ring_bytes)
        self.context = zmq.Context()
        self.front = wire.open_socket(
            self.context,
            zmq.PUSH,
            send_timeout_ms=5000,
            bind=internal_address(self.settings, "tokenize"),
        )
        self.answers = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(self.settings, "front")
        )
        self.stage = TokenizerStage(stage_settings(self.settings, "tokenizer"), 0)
        self.stage.open()
        self.sent = 0

    def send(self, deadline_s: float) -> None:
        """TOKENIZE of an 8-line text chunk (job 7) due at `deadline_s` on the test's clock."""
        source = self.tmp_path / f"in{self.sent}.jsonl"
        write_jsonl(source, 8, seed=self.sent, text_every=1)
        chunk = next(iter_batch_input(source, self.settings, chunk_lines=8))
        meta, arrays = chunk_to_wire(chunk)
        meta.update(index=self.sent, job_no=7, deadline_ns=round(deadline_s * 1e9))
        wire.send(self.front, MT.TOKENIZE, meta, arrays)
        self.sent += 1

    def answer(self, now: float) -> wire.Message:
        """Step at `now` until the stage answers the front."""

        def answered():
            self.stage.step(now)
            return wire.recv(self.answers, 0)

        return wait_for(answered, "the tokenizer's TOKENIZED", 10)

    def close(self) -> None:
        self.stage.close()
        self.front.close(0)
        self.answers.close(0)
        self.context.term()
        self.ring.close()
        Ring.unlink(self.spec.name)


@pytest.fixture
def small_ring(tmp_path):
    harness = Harness(tmp_path, 1 << 12)
    try:
        yield harness
    finally:
        harness.close()


def test_a_chunk_is_tokenized_into_its_router_ring_and_reported(small_ring):
    h = small_ring
    h.send(T0 + TIMEOUT_S)
    answer = h.answer(T0)
    assert answer.type == MT.TOKENIZED and "failed" not in answer.meta
    assert answer.meta["forwarded"] == 7  # one line in ten (the first) is too long for texty
    _, payload = h.ring.get()
    items = read_items(payload)
    assert items.job_no == 7 and len(items.index) == 7
    h.ring.release()


def fill(h: Harness) -> None:
    """Chunks until one finds the ring full (nobody reads it); that one waits in the stage."""
    for _ in range(50):
        h.send(T0 + TIMEOUT_S)
        wait_for(lambda: (h.stage.step(T0), h.stage.waiting or h.stage.done == h.sent)[1], "a step")
        if h.stage.waiting is not None:
            return
        assert wire.recv(h.answers, 5000).meta["forwarded"] > 0
    raise AssertionError("the ring never filled")


def test_a_chunk_waits_for_room_until_its_deadline_on_the_stage_s_clock(small_ring):
    h = small_ring
    fill(h)
    for _ in range(20):  # before the deadline: it waits, however long the wall clock runs
        h.stage.step(T0 + TIMEOUT_S)
    assert h.stage.waiting is not None and wire.recv(h.answers, 0) is None
    answer = h.answer(T0 + TIMEOUT_S + 0.001)
    assert answer.meta["failed"] == "the router did not take the chunk before its deadline"
    assert answer.meta["chunk"] == h.sent - 1 and h.stage.waiting is None


def test_a_waiting_chunk_goes_once_the_router_makes_room(small_ring):
    h = small_ring
    fill(h)
    h.stage.step(T0 + 1)
    assert h.stage.waiting is not None
    while h.ring.get() is not None:  # the router reads the ring
        h.ring.release()
    answer = h.answer(T0 + 2)
    assert "failed" not in answer.meta and answer.meta["chunk"] == h.sent - 1
    assert answer.meta["forwarded"] > 0 and h.stage.waiting is None
