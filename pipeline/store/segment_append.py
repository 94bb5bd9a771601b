"""Appending to segments: ids handed out once, and the rotating appender a writer keeps
for each key (the segment log itself is the files; docs/segment-log.md).

Ids increase and are never reused, across processes and restarts: they come
from `<data_dir>/next-segment-id` under an exclusive flock, and never below
one more than the largest id of any segment file present (so a lost or stale
counter file cannot hand out an id twice while the files exist).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from pipeline.core.errors import SegmentError
from pipeline.store.counter import DurableCounter
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.store.segment_format import (
    HEADER_BYTES,
    SegmentKey,
    capacity_for,
    marker_region_bytes,
)

# What a writer tells the stages after it: items seq..seq+count sit in
# (segment, first .. first+count).
DESCRIPTOR_DTYPE = np.dtype([("segment", "<u8"), ("first", "<u4"), ("count", "<u4")])

_ID_IN_NAME = re.compile(r"^(?:in|out)-(\d+)\.")


class SegmentIds:
    """Hands out segment ids: increasing, never reused, safe across processes."""

    FILE = "next-segment-id"

    def __init__(self, data_dir: DataDir) -> None:
        self._data_dir = data_dir
        self._counter = DurableCounter(data_dir.root / self.FILE)

    def _largest_present(self) -> int:
        largest = 0
        for path in self._data_dir.segment_files() + self._data_dir.temp_files():
            match = _ID_IN_NAME.match(path.name.lstrip("."))
            if match:
                largest = max(largest, int(match.group(1)))
        return largest

    def allocate(self) -> int:
        """Return a fresh id; the next one is durable before this returns."""
        return self._counter.next(floor=self._largest_present() + 1)


class SegmentAppender:
    """Appends items of one key, rotating to a new segment when full or idle.

    Owned by one writer thread. `append()` fills the current segment and opens
    new ones as needed; nothing is durable until `sync()`, which issues one
    fdatasync per segment written since the last sync (group commit) and then
    closes the segments that were rotated out.

    Segments grow with the key's traffic: the first holds what `min_bytes`
    holds (or `expect()`'s count of items, if larger), each one opened because
    the last filled up holds twice as many, up to `segment_bytes`; a rotation
    for idleness starts small again. So a quiet key costs a small file, a busy
    one reaches full-size segments after a few rotations. Each file's header
    says its own capacity; nothing reading segments assumes one size.
    """

    def __init__(
        self,
        data_dir: DataDir,
        key: SegmentKey,
        slot_bytes: int,
        segment_bytes: int,
        ids: SegmentIds,
        idle_s: float = 30.0,
        drop_synced_pages: bool = False,
        min_bytes: int | None = None,
    ) -> None:
        smallest = HEADER_BYTES + marker_region_bytes(1) + slot_bytes
        if segment_bytes < smallest:
            raise SegmentError(
                f"segment_bytes {segment_bytes} cannot hold one slot of {slot_bytes} bytes "
                f"(lane {key.lane}); raise broker.segment_bytes to at least {smallest}"
            )
        self.key = key
        self.slot_bytes = slot_bytes
        self.capacity = capacity_for(segment_bytes, slot_bytes)  # the largest segment's
        first = segment_bytes if min_bytes is None else min(max(min_bytes, smallest), segment_bytes)
        self.min_capacity = capacity_for(first, slot_bytes)
        self._next_capacity = self.min_capacity
        self.idle_s = idle_s
        self.drop_synced_pages = drop_synced_pages
        self._directory: Path = data_dir.segment_dir(key.kind)
        self._ids = ids
        self._current: Segment | None = None
        self._dirty: list[Segment] = []
        self._ready: list[Segment] = []  # created for a batch, not yet written

    @property
    def current(self) -> Segment | None:
        return self._current

    def expect(self, items: int) -> None:
        """A hint: about `items` more will come, so the next segment may be sized to hold them
        (between the smallest and the largest size). Never shrinks a planned segment."""
        wanted = min(max(items, self.min_capacity), self.capacity)
        self._next_capacity = max(self._next_capacity, wanted)

    def append(
        self,
        seq: np.ndarray,
        job: np.ndarray,
        index: np.ndarray,
        count: np.ndarray,
        body: np.ndarray,
        flags: np.ndarray | None = None,
    ) -> np.ndarray:
        """Append n items; return their placement as DESCRIPTOR_DTYPE rows.

        All or nothing with respect to the disk: every segment the batch needs
        is created (and its space reserved) before the first item is written,
        so a full disk raises DiskFullError with nothing of the batch stored.
        """
        n = len(seq)
        self._reserve(n)
        placed = []
        start = 0
        while start < n:
            segment = self._current
            if segment is None or segment.free_slots == 0:
                self._seal_current()
                segment = self._current = self._ready.pop(0)
            take = min(segment.free_slots, n - start)
            stop = start + take
            first = segment.append(
                seq[start:stop],
                job[start:stop],
                index[start:stop],
                count[start:stop],
                body[start:stop],
                None if flags is None else flags[start:stop],
            )
            if segment not in self._dirty:
                self._dirty.append(segment)
            placed.append((segment.segment_id, first, take))
            start = stop
        return np.array(placed, dtype=DESCRIPTOR_DTYPE)

    def _reserve(self, n: int) -> None:
        room = (self._current.free_slots if self._current is not None else 0) + sum(
            segment.capacity for segment in self._ready
        )
        while room < n:
            segment = Segment.create(
                self._directory,
                self._ids.allocate(),
                self.key,
                self.slot_bytes,
                self._next_capacity,
            )
            self._next_capacity = min(2 * self._next_capacity, self.capacity)
            self._ready.append(segment)
            room += segment.capacity

    @property
    def dirty(self) -> bool:
        """True while something appended or sealed is not yet handed to a sync."""
        return bool(self._dirty)

    def begin_sync(self) -> list[tuple[Segment, int | None]]:
        """Hand over what needs syncing: each segment written or sealed since the last hand-off,
        with its end then. The caller fdatasyncs each (`Segment.fdatasync`, safe on another
        thread while appends go on) and then calls `end_sync` with the outcome, on this
        appender's thread; until then no segment of the list is closed."""
        batch = [(segment, segment.end_slot) for segment in self._dirty]
        self._dirty = []
        return batch

    def end_sync(self, batch: list[tuple[Segment, int | None]], ok: bool) -> None:
        """After the fdatasyncs of a `begin_sync` batch: on success, drop the synced pages and
        close the segments rotated out that nothing written since still needs; on failure,
        the segments are synced again by the next batch."""
        if not ok:
            self._dirty[:0] = [s for s, _ in batch if s not in self._dirty]
            return
        for segment, end in batch:
            segment.synced(end, self.drop_synced_pages)
        for segment, _ in batch:
            if segment is not self._current and segment not in self._dirty:
                segment.close()

    def sync(self) -> None:
        """Make every append so far durable (one fdatasync per segment written since the last
        sync: group commit); then release segments rotated out."""
        batch = self.begin_sync()
        try:
            for segment, _ in batch:
                segment.fdatasync()
        except BaseException:
            self.end_sync(batch, ok=False)
            raise
        self.end_sync(batch, ok=True)

    def maybe_rotate(self, now_s: float | None = None) -> bool:
        """Seal the current segment if it has been idle for `idle_s`; True if it did."""
        segment = self._current
        now_s = time.monotonic() if now_s is None else now_s
        if segment is None or now_s - segment.last_append_s < self.idle_s:
            return False
        self._seal_current()
        if not self._ready:  # quiet again: the next segment starts small
            self._next_capacity = self.min_capacity
        return True

    def close(self) -> None:
        """Seal the current and any unused segments, and sync everything outstanding."""
        self._seal_current()
        while self._ready:
            self._current = self._ready.pop(0)
            self._seal_current()
        self.sync()

    def _seal_current(self) -> None:
        segment = self._current
        if segment is None:
            return
        segment.seal()
        if segment not in self._dirty:
            self._dirty.append(segment)
        self._current = None
