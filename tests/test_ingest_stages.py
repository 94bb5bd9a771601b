"""Router and writer stages stepped in-process, on a clock of the test's own.

A malformed message on their wakeup socket is logged, counted and skipped
(pipeline/wire/sockets.py Inbox), never raised out of step(); a writer judges a
record's deadline on the `now` it is given; a router keeps an input record until the groups
cut from it are in a writer ring."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from broker import write_config
from conftest import wait_for

from config import load_settings
from pipeline import wire
from pipeline.datadir import DataDir
from pipeline.ring import Ring
from pipeline.ring_records import KEYED, Items, Keyed, put_items, put_keyed, read_keyed
from pipeline.topology import internal_address, rings_to
from router.router_stage import RouterStage
from router.writer_stage import WriterStage


@pytest.mark.parametrize("stage_class", [RouterStage, WriterStage])
def test_a_malformed_wakeup_is_counted_and_skipped(tmp_path, stage_class):
    settings = load_settings(write_config(tmp_path))
    DataDir(settings.data_path).ensure()
    stage = stage_class(settings, 0)
    stage.open()
    context = zmq.Context()
    sender = wire.open_socket(
        context,
        zmq.PUSH,
        send_timeout_ms=5000,
        connect=internal_address(settings, f"{stage.name}-0"),
    )
    try:
        sender.send_multipart([b"not a message"])

        def skipped() -> bool:
            stage.step(1000.0)
            return stage.wakeups.dropped == 1

        wait_for(skipped, f"the {stage.name} to skip the malformed wakeup", 10)
        stage.step(1000.0)  # and it goes on stepping
    finally:
        sender.close(0)
        context.term()
        stage.close()


def test_a_writer_judges_a_record_s_deadline_on_its_own_clock(tmp_path):
    """A record is appended and acknowledged before its deadline and dropped unappended after
    it, by the `now` the writer is given (no group-commit window: flush_ms = 0)."""
    settings = load_settings(write_config(tmp_path), {"writers": {"flush_ms": 0}})
    DataDir(settings.data_path).ensure()
    (spec,) = rings_to(settings, "writer-0")
    ring = Ring.create(spec.name, 1 << 20)
    stage = WriterStage(settings, 0)
    stage.open()
    context = zmq.Context()
    front = wire.open_socket(context, zmq.PULL, bind=internal_address(settings, "front"))
    deadline_s = 1005.0

    def keyed(chunk: int) -> Keyed:
        tokens = np.arange(1, 9, dtype=np.uint32).reshape(2, 4)
        index = np.array([2 * chunk, 2 * chunk + 1], np.uint32)
        lengths = np.array([4, 4], np.uint32)
        return Keyed(7, chunk, round(deadline_s * 1e9), "echo", 1, 64, index, lengths, tokens)

    try:
        assert put_keyed(ring, keyed(0)) is not None
        stage.step(deadline_s - 1)
        ack = wire.recv(front, 5000)
        assert ack is not None and ack.type == wire.MessageType.APPEND_ACK
        assert (ack.meta["chunk"], ack.meta["count"]) == (0, 2) and stage.appended == 2
        assert put_keyed(ring, keyed(1)) is not None
        stage.step(deadline_s + 0.001)
        assert stage.appended == 2, "a record past its deadline must not be appended"
        assert ring.used_bytes == 0, "it is taken off the ring all the same"
    finally:
        front.close(0)
        context.term()
        stage.close()
        ring.close()
        Ring.unlink(spec.name)


def test_a_router_waiting_for_a_full_writer_ring_keeps_its_input_record(tmp_path):
    """A router whose writer ring is full keeps the input record its pending groups point into
    until they are placed: same-length items are grouped without a copy (a view of the
    front's ring), so releasing that record early would let the front overwrite the tokens
    before they reach the writer (here: chunk 0's ones replaced by chunk 1's twos)."""
    settings = load_settings(write_config(tmp_path))
    DataDir(settings.data_path).ensure()
    (front_spec,) = [r for r in rings_to(settings, "router-0") if r.src.startswith("front")]
    (writer_spec,) = rings_to(settings, "writer-0")
    width = 64

    def items(chunk: int, value: int) -> Items:
        return Items(
            1, chunk, 2**62, ["echo"], [{"endpoint": "/v1/completions", "max_tokens": 4}],
            np.arange(4 * chunk, 4 * chunk + 4, dtype=np.uint32), np.zeros(4, np.uint32),
            np.zeros(4, np.uint32), np.full(4, width, np.uint32),
            np.full(4 * width, value, np.uint32),
        )  # fmt: skip

    front_ring = Ring.create(front_spec.name, 1 << 16)
    assert put_items(front_ring, items(0, 1)) is not None
    record_bytes = front_ring.head  # room for two records: the third lands on the first
    front_ring.close()
    Ring.unlink(front_spec.name)
    front_ring = Ring.create(front_spec.name, 2 * record_bytes)
    writer_ring = Ring.create(writer_spec.name, 1 << 16)
    router = RouterStage(settings, 0)
    router.open()
    try:
        filler = Keyed(9, 0, 2**62, "echo", 1, width, np.zeros(1, np.uint32),
                       np.ones(1, np.uint32), np.ones((1, width), np.uint32))  # fmt: skip
        while put_keyed(writer_ring, filler) is not None:  # the writer is behind
            pass
        fillers = writer_ring.head
        assert put_items(front_ring, items(0, 1)) is not None
        router.step(1000.0)
        assert router.pending, "the writer ring is full: the group waits in the router"
        # the front goes on: chunk 1 fits beside chunk 0's record; chunk 2 would land on it,
        # were it released (kept, the ring is full: backpressure reaches the front)
        assert put_items(front_ring, items(1, 2)) is not None
        put_items(front_ring, items(2, 2))
        while writer_ring.get() is not None:  # the writer catches up
            pass
        writer_ring.release()
        wait_for(lambda: router.step(1000.0) or not router.pending, "the router to place", 10)
        kind, payload = writer_ring.get()
        assert writer_ring.tail == fillers and kind == KEYED
        keyed = read_keyed(payload)
        assert keyed.chunk == 0
        assert (keyed.tokens == 1).all(), "chunk 0's tokens were overwritten in the front's ring"
    finally:
        router.close()
        for ring, spec in ((front_ring, front_spec), (writer_ring, writer_spec)):
            ring.close()
            Ring.unlink(spec.name)
