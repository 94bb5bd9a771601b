"""Router and writer stages stepped in-process, on a clock of the test's own.

A malformed message on their wakeup socket is logged, counted and skipped
(pipeline/transport/wire/sockets.py Inbox), never raised out of step(); a writer judges a
record's deadline on the `now` it is given, appends the next step's records while
the last step's segments sync and answers a chunk only once its sync is back
(failed exactly when that sync failed); a router keeps an input record until the groups
cut from it are in a writer ring."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq
from broker import write_config
from conftest import wait_for

from config import load_settings
from config.stage_settings import stage_settings
from pipeline.core.errors import DiskFullError
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.transport import wire
from pipeline.transport.ring import Ring
from pipeline.transport.ring_records import KEYED, Items, Keyed, put_items, put_keyed, read_keyed
from pipeline.transport.topology import internal_address, rings_to
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
    stage = WriterStage(stage_settings(settings, "writer"), 0)
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
        # acknowledged once its sync is back, in this step or a later one
        wait_for(lambda: stage.step(deadline_s - 1) or stage.appended, "the ack", 10)
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


class GatedSync:
    """Segment.fdatasync held until `gate` is set (at most `hold_s`, then noted in `held_too_long`
    and let through, so a writer that syncs on its own thread fails its test instead of hanging
    it); the first one raises a full disk if `fail_first`."""

    def __init__(self, monkeypatch, fail_first: bool = False, hold_s: float = 5.0) -> None:
        self.gate = threading.Event()
        self.began = 0
        self.returned = 0
        self.held_too_long = 0
        self.fail_first = fail_first
        real = Segment.fdatasync

        def fdatasync(segment: Segment) -> None:
            self.began += 1
            if not self.gate.wait(hold_s):
                self.held_too_long += 1
            if self.fail_first and self.began == 1:
                raise DiskFullError(f"{segment.path}: disk full while syncing (test)")
            real(segment)
            self.returned += 1

        monkeypatch.setattr(Segment, "fdatasync", fdatasync)


class SteppedWriter:
    """A writer stage with one input ring and the front's end of its answers, in this process."""

    def __init__(self, tmp_path) -> None:
        self.settings = load_settings(write_config(tmp_path), {"writers": {"flush_ms": 0}})
        DataDir(self.settings.data_path).ensure()
        (self.spec,) = rings_to(self.settings, "writer-0")
        self.ring = Ring.create(self.spec.name, 1 << 20)
        self.stage = WriterStage(stage_settings(self.settings, "writer"), 0)
        self.stage.open()
        self.context = zmq.Context()
        self.front = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(self.settings, "front")
        )
        self.answers: dict[int, wire.Message] = {}  # chunk -> its answer

    def release_after_second_append(self, sync: GatedSync) -> list[int]:
        """Set `sync.gate` once the stage has appended its second record (chunk 1); the list
        gets how many fdatasyncs had returned by then."""
        returned_then: list[int] = []
        append = self.stage._append

        def watched_append(*args) -> None:
            append(*args)
            if sum(self.stage.appended_by_key.values()) == 4 and not returned_then:
                returned_then.append(sync.returned)
                sync.gate.set()

        self.stage._append = watched_append
        return returned_then

    def put(self, chunk: int) -> None:
        tokens = np.full((2, 4), chunk + 1, dtype=np.uint32)
        index = np.array([2 * chunk, 2 * chunk + 1], np.uint32)
        record = Keyed(7, chunk, 2**62, "echo", 1, 64, index, np.full(2, 4, np.uint32), tokens)
        assert put_keyed(self.ring, record) is not None

    def step_until_answered(self, chunks: set[int]) -> None:
        def answered() -> bool:
            self.stage.step(1000.0)
            while (message := wire.recv(self.front, 0)) is not None:
                self.answers[message.meta["chunk"]] = message
            return chunks <= self.answers.keys()

        wait_for(answered, f"answers for chunks {sorted(chunks)}", 20)

    def close(self) -> None:
        self.front.close(0)
        self.context.term()
        self.stage.close()
        self.ring.close()
        Ring.unlink(self.spec.name)


def test_a_writer_appends_the_next_step_while_the_last_syncs_and_acks_only_after_it(
    tmp_path, monkeypatch
):
    """Step 1's fdatasync is held until the writer has appended chunk 1: step 1 returns
    without waiting for it, step 2 takes and appends chunk 1 while it is held, and no
    APPEND_ACK leaves before an fdatasync has returned; then both chunks are acknowledged."""
    sync = GatedSync(monkeypatch)
    writer = SteppedWriter(tmp_path)
    returned_at_chunk_1 = writer.release_after_second_append(sync)
    acked_before_sync: list[int] = []
    tell = writer.stage._tell

    def watched_tell(msg_type, meta, flags=0, arrays=None) -> None:
        if msg_type == wire.MessageType.APPEND_ACK and sync.returned == 0:
            acked_before_sync.append(meta["chunk"])
        tell(msg_type, meta, flags, arrays)

    writer.stage._tell = watched_tell
    try:
        writer.put(0)
        writer.stage.step(1000.0)
        wait_for(lambda: sync.began, "step 1's sync to begin", 10)
        assert not sync.held_too_long, "step 1 waited for its own fdatasync"
        assert writer.stage.appended == 0 and wire.recv(writer.front, 0) is None
        writer.put(1)
        writer.step_until_answered({0, 1})
        assert returned_at_chunk_1 == [0], "chunk 1 must be appended while step 1's sync is held"
        for chunk in (0, 1):
            answer = writer.answers[chunk]
            assert answer.type == wire.MessageType.APPEND_ACK and answer.meta["count"] == 2
        assert not acked_before_sync, "an APPEND_ACK left before its fdatasync returned"
        assert writer.stage.appended == 4 and not sync.held_too_long
    finally:
        sync.gate.set()
        writer.close()


def test_a_failed_sync_refuses_exactly_its_step_s_chunks_while_the_next_step_goes_on(
    tmp_path, monkeypatch
):
    """Step 1's fdatasync fails with a full disk after chunk 1 was appended (held until then):
    chunk 0 gets a retryable error, chunk 1 (synced by its own step, which syncs the segment
    again) an APPEND_ACK, and the full-disk episode is opened."""
    sync = GatedSync(monkeypatch, fail_first=True)
    writer = SteppedWriter(tmp_path)
    returned_at_chunk_1 = writer.release_after_second_append(sync)
    try:
        writer.put(0)
        writer.stage.step(1000.0)
        wait_for(lambda: sync.began, "step 1's sync to begin", 10)
        assert not sync.held_too_long, "step 1 waited for its own fdatasync"
        writer.put(1)
        writer.step_until_answered({0, 1})
        assert returned_at_chunk_1 == [0], "chunk 1 must be appended while step 1's sync is held"
        refused, acked = writer.answers[0], writer.answers[1]
        assert refused.type == wire.MessageType.ERROR and refused.retryable
        assert "disk full" in refused.meta["reason"]
        assert acked.type == wire.MessageType.APPEND_ACK and acked.meta["count"] == 2
        assert writer.stage.appended == 2 and writer.stage.disk.episode
        assert sync.returned >= 1, "chunk 1's step synced the segment again"
    finally:
        sync.gate.set()
        writer.close()


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
    router = RouterStage(stage_settings(settings, "router"), 0)
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


def test_a_record_delivered_twice_is_appended_and_acknowledged_once(tmp_path):
    """The same KEYED record twice in a writer's ring (what a ring read again by a second
    consumer, or a record routed again, delivers): its items are appended once and the chunk
    acknowledged for them once. Counted twice, the chunk's commit says it stored twice its
    lines and its job waits for ever for results that never come (docs/ingest.md,
    "Exactly once into the log")."""
    writer = SteppedWriter(tmp_path)
    try:
        writer.put(0)
        writer.put(0)
        writer.step_until_answered({0})
        wait_for(
            lambda: writer.stage.step(1000.0) or writer.stage.syncer.in_flight is None,
            "the writer's last sync",
            10,
        )
        acks = [writer.answers[0]]
        while (message := wire.recv(writer.front, 200)) is not None:
            acks.append(message)  # a second answer for the chunk, if the copy was appended
        assert all(m.type == wire.MessageType.APPEND_ACK for m in acks), [m.meta for m in acks]
        assert sum(m.meta["count"] for m in acks) == 2, [m.meta for m in acks]
        assert writer.stage.appended == 2, "the second copy must not reach the log"
        assert sorted(np.concatenate([m.arrays["index"] for m in acks]).tolist()) == [0, 1]
    finally:
        writer.close()
