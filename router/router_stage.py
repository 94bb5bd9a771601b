"""The router stage: give every item its shape id and lane, and send it to its writer.

A router reads ITEMS records (from the front and the tokenizers), looks up
each distinct shape in the shared shape table (adding new ones durably),
puts each item in the smallest lane that holds it, groups the items by
(model, shape, lane), pads each group's tokens to its longest item, and
writes one KEYED record per group into the ring of the writer that owns the
key (a stable hash of the key, so a key always maps to one writer). A full
writer ring stops the router from reading more: backpressure reaches the
front and, through it, the producers.

Groups of same-length items are views of the input record (no copy), so an
input record is released only once every group cut from it is in a writer
ring: released earlier, its bytes could be overwritten by the front's next
record while a group still waits for room.
"""

from __future__ import annotations

import time
import zlib
from collections import deque

import numpy as np
import zmq

from config.stage_settings import RouterStageSettings
from pipeline.core.idle_wait import IdleWait
from pipeline.core.ragged import offsets_of, pad
from pipeline.process.stage import Stage
from pipeline.store.intern_table import InternTable
from pipeline.transport import wire
from pipeline.transport.outlet import Outlet
from pipeline.transport.ring_port import RingPort
from pipeline.transport.ring_records import (
    ITEMS,
    Items,
    Keyed,
    put_keyed,
    read_items,
    split_keyed,
)
from pipeline.transport.topology import internal_address, rings_to


def writer_for(model: str, shape: int, lane: int, writers: int) -> int:
    """The writer that owns a key: stable across processes and restarts."""
    return zlib.crc32(f"{model}/{shape}/{lane}".encode()) % writers


def group_by_key(items: Items, shape_ids: np.ndarray, lanes: np.ndarray) -> list[Keyed]:
    """Split a batch into one Keyed group per (model, shape id, lane), tokens padded."""
    lengths = items.lengths.astype(np.int64)
    lane_index = np.searchsorted(lanes, lengths)
    if len(lengths) and (lane_index.max() >= len(lanes) or lengths.min() < 1):
        raise ValueError(
            f"job {items.job_no} chunk {items.chunk}: an item is empty or longer than the largest lane"
        )
    lane_of = lanes[lane_index]
    shape_of = shape_ids[items.shape_index]
    key = (
        (items.model_index.astype(np.int64) << 48) | (shape_of.astype(np.int64) << 20) | lane_index
    )
    starts = offsets_of(lengths)[:-1]
    groups = []
    order = np.argsort(key, kind="stable")
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    for members in np.split(order, bounds) if len(order) else []:
        first = members[0]
        groups.append(
            Keyed(
                items.job_no,
                items.chunk,
                items.deadline_ns,
                items.models[int(items.model_index[first])],
                int(shape_of[first]),
                int(lane_of[first]),
                items.index[members],
                items.lengths[members],
                pad(items.tokens, starts[members], lengths[members]),
            )
        )
    return groups


class RouterStage(Stage[RouterStageSettings]):
    name = "router"
    poller: zmq.Poller  # made by open()
    poll_ms = 50

    def open(self) -> None:
        settings = self.settings
        self.lanes = np.array(settings.broker.lanes, dtype=np.int64)
        self.shapes = InternTable(settings.data_path)
        self.inputs = [RingPort(r.name) for r in rings_to(settings, self.label)]
        self.context = zmq.Context()
        wakeups = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(settings, self.label)
        )
        self.wakeups = wire.Inbox(wakeups, self.log, "a front or tokenizer")
        self.poller = zmq.Poller()  # the idle wait (run_stage adds its signal wake)
        self.poller.register(wakeups, zmq.POLLIN)
        self.outlet = Outlet(self.context, settings, self.label, "writer")
        self.pending: deque[tuple[int, Keyed]] = deque()  # groups waiting for room in a writer ring
        self.held: list = []  # input rings whose last record `pending` still points into
        self.routed = 0
        self.idle = IdleWait(self.poll_ms)  # how long an idle step waits for a wakeup

    def _shape_ids(self, shapes: list[dict]) -> np.ndarray:
        return np.array([self.shapes.id_for(shape) for shape in shapes], dtype=np.int64)

    def _flush_pending(self) -> bool:
        """Put waiting groups into writer rings, then release the input records they came
        from; True when none are left."""
        while self.pending:
            writer, keyed = self.pending[0]
            if not self.outlet.try_put(writer, put_keyed, keyed):
                return False
            self.pending.popleft()
            self.routed += len(keyed.index)
        for ring in self.held:
            ring.release()
        self.held = []
        return True

    def step(self, now: float) -> None:
        if not self._flush_pending():
            self.idle.busy()
            self.wakeups.drain(5, most=1)  # writers are behind: wait for room, read nothing new
            return
        idle = True
        for port in self.inputs:
            ring = port.get(now)
            if ring is None:
                continue
            record = ring.get()
            if record is None:
                continue
            idle = False
            self.idle.busy()
            kind, payload = record
            groups = []
            if kind == ITEMS:
                items = read_items(payload)
                try:
                    groups = group_by_key(items, self._shape_ids(items.shapes), self.lanes)
                except ValueError as exc:  # the front checks lengths; this is a bug upstream
                    self.log.error("ring %s: %s; batch dropped", port.name, exc)
                for keyed in groups:
                    writer = writer_for(keyed.model, keyed.shape, keyed.lane, len(self.outlet))
                    for piece in split_keyed(keyed):  # may be views of the record
                        self.pending.append((writer, piece))
            else:
                self.log.error("ring %s: unexpected record kind %d; dropped", port.name, kind)
            self.held.append(ring)  # released once its groups are placed
            if not self._flush_pending():
                return
        # Idle: wait once for a wakeup, then take the others already queued.
        if idle and self.poller.poll(self.idle.wait_ms(now)):
            self.wakeups.drain(0)

    def drain(self, deadline: float) -> None:
        self.idle.busy()  # short idle waits: a step that routes nothing ends the drain
        while time.monotonic() < deadline:
            before = self.routed
            self.step(time.monotonic())
            if self.routed == before and not self.pending:
                break

    def close(self) -> None:
        for port in self.inputs:
            port.close()
        self.outlet.close()
        self.wakeups.socket.close(0)
        self.context.term()
