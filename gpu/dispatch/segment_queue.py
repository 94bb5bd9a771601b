"""One input segment as dispatch queues it: cursor, written end, the slots out, and the scan.

Memory is per segment, never per queued item: a cursor, the written end and,
while any slot is out, one bool per slot of capacity (`out`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, STATE_MASK, live_markers

SCAN_MARKERS = 1 << 16  # markers examined per step when looking for free slots


@dataclass(frozen=True)
class Queued:
    """One segment's part of the queue (DispatchState.queue_depth)."""

    segment_id: int
    model: str
    shape: int
    lane: int
    waiting: int  # items waiting to be handed out
    cursor: int  # the next slot to look at
    floor: int  # the lowest slot that may wait again: the cursor or the earliest on lease
    created_ns: int  # the segment's creation (wall clock): its oldest item is no older


@dataclass(eq=False)
class SegmentQueue:
    """One input segment's queue: every slot before `cursor` is out, retired or never written;
    `out` marks the slots from there that must not be offered."""

    segment: Segment
    priority: int
    cursor: int
    end: int
    out: np.ndarray | None = None  # bool per slot: not offered, not waiting (`mark_out`)
    not_before: float = 0.0  # nothing is handed out before this (re-registration grace)
    batches: set[int] | None = None  # lease ids with items of this segment

    @property
    def model(self) -> str:
        return self.segment.key.name

    def has_work(self) -> bool:
        return self.cursor < self.end

    def candidates(self, budget: int, start: int | None = None) -> tuple[np.ndarray, int]:
        """Up to `budget` LIVE slots not out on lease, from the cursor (or from `start`, past
        it: a deadline's pick); and how far that scanned.

        Every slot from where it began to the returned position is out, retired
        or never written, so the cursor may move there once the batch is committed.
        Markers are read in windows, so a long backlog is never scanned whole.
        """
        found_parts: list[np.ndarray] = []
        need = budget
        start = self.cursor if start is None else start
        while start < self.end and need > 0:
            stop = min(self.end, start + max(SCAN_MARKERS, 2 * need))
            free = live_markers(self.segment.markers[start:stop])
            if self.out is not None:
                free &= ~self.out[start:stop]
            hits = np.flatnonzero(free)[:need] + start
            found_parts.append(hits)
            need -= len(hits)
            if need == 0:
                return np.concatenate(found_parts).astype(np.int64), int(hits[-1]) + 1
            start = stop
        found = np.concatenate(found_parts) if found_parts else np.zeros(0, np.int64)
        return found.astype(np.int64), self.end

    def claimed(
        self, slots: np.ndarray, seqs: np.ndarray, held_by_me: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """A re-registering worker says it holds these slots (with these seqs): per slot, is it
        LIVE with that seq (`ok`), and is it out with another session (`elsewhere`)?"""
        inside = slots < self.end
        ok = np.zeros(len(slots), bool)
        ok[inside] = live_markers(self.segment.markers[slots[inside]]) & (
            self.segment.slots["seq"][slots[inside]] == seqs[inside]
        )
        elsewhere = ok & ~held_by_me
        if self.out is not None:  # (a slot past the written end is never `ok`)
            elsewhere[inside] &= self.out[slots[inside]]
        else:
            elsewhere[:] = False
        return ok, elsewhere

    def mark_out(self, slots: np.ndarray) -> None:
        """These slots are out (on lease, quarantined, dead-lettered, cancelled, retired): not
        offered, not waiting. A retired slot stays out (its marker is DEAD for good)."""
        if self.out is None:
            self.out = np.zeros(self.segment.capacity, dtype=bool)
        self.out[slots] = True

    def mark_retired_on_disk(self, start: int, stop: int) -> None:
        """Mark out the slots from `start` to `stop` whose marker is DEAD already (retired in
        an earlier life: a cancelled job's items among others still queued), once, when the
        segment is loaded: they never wait."""
        dead = np.flatnonzero((self.segment.markers[start:stop] & STATE_MASK) == DEAD)
        if len(dead):
            self.mark_out(dead + start)

    def waiting(self) -> int:
        """Slots from the cursor to the written end not out: what waits to be handed out."""
        waiting = max(0, self.end - self.cursor)
        if waiting and self.out is not None:
            waiting -= int(np.count_nonzero(self.out[self.cursor : self.end]))
        return waiting

    def unsent_from(self, start: int) -> np.ndarray:
        """LIVE slots from `start` to the written end that are not out."""
        live = live_markers(self.segment.markers[start : self.end])
        if self.out is not None:
            live &= ~self.out[start : self.end]
        return np.arange(start, self.end)[live]

    def finished(self) -> bool:
        """Sealed, written to its end, fully handed out, no lease and no LIVE slot left: the
        segment collector's from now on."""
        segment = self.segment
        if self.has_work() or self.batches or not segment.sealed or self.end < segment.entries:
            return False
        return not live_markers(segment.markers[: self.end]).any()

    def queued(self, floor: int) -> Queued:
        """Its row of the queue depth; `floor`: the lowest slot on lease here, or the cursor."""
        key = self.segment.key
        return Queued(
            self.segment.segment_id, key.name, key.shape, key.lane, self.waiting(), self.cursor,
            floor, self.segment.header.created_ns,
        )  # fmt: skip
