"""The completion stage's durable path: output, then tombstone, then count (invariant 3).

`CompletionLog.record()` takes a batch of results from a worker and, for
each item, first checks the input slot it answers: a slot already DEAD, or
an item that already has a result in the completion log, is a duplicate
(computation can repeat, observable completion happens once: invariant 5);
a seq that does not match the slot's is refused (a stale or forged result).
The new results are appended to the job's completion segments (the same
segment format, kind 2, keyed by job; the slot's `flags` word says result
(0) or error result (1)) and synced: one fdatasync per touched segment.
Only then are the input markers written DEAD; `flush_tombstones()` makes
them durable about every 100 ms (one fdatasync per touched input segment)
and returns what retired, which is when dispatch may forget the items and
the worker may be acknowledged. Duplicates of items that already have a
result are retired too, so a crash between output and tombstone heals.

Per job, a bitmap of the item indexes that have a result is the exact
counter: it is rebuilt from the completion log itself (`load_job`), never
from a persisted count, so progress never doubles after a restart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.datadir import DataDir
from pipeline.segment import Segment
from pipeline.segment_format import (
    DEAD,
    EMPTY,
    KIND_COMPLETION,
    LIVE,
    STATE_MASK,
    SegmentKey,
    slot_bytes_for,
)
from pipeline.segment_log import SegmentAppender, SegmentIds

RESULT = 0
ERROR_RESULT = 1


@dataclass(eq=False)
class Results:
    """One worker batch of results, all for one job."""

    job_id: str
    job_no: int
    segment: np.ndarray  # u8 per item: the input segment
    slot: np.ndarray  # u4
    seq: np.ndarray  # u8
    status: np.ndarray  # u4: RESULT or ERROR_RESULT
    payload: np.ndarray  # u1, every item's bytes back to back
    offsets: np.ndarray  # i8, n + 1


@dataclass(eq=False)
class Recorded:
    stored: int  # new results made durable
    duplicates: int  # already DEAD, or already had a result
    refused: list[str]  # one line per refused item (seq mismatch, never written, too big)


class _Job:
    def __init__(self, appender: SegmentAppender) -> None:
        self.appender = appender
        self.has_result = np.zeros(1024, dtype=bool)

    def mark(self, index: np.ndarray) -> None:
        if len(index) and int(index.max()) >= len(self.has_result):
            grown = np.zeros(max(int(index.max()) + 1, 2 * len(self.has_result)), dtype=bool)
            grown[: len(self.has_result)] = self.has_result
            self.has_result = grown
        self.has_result[index] = True

    def seen(self, index: np.ndarray) -> np.ndarray:
        inside = index < len(self.has_result)
        out = np.zeros(len(index), dtype=bool)
        out[inside] = self.has_result[index[inside]]
        return out

    @property
    def completed(self) -> int:
        return int(self.has_result.sum())


class CompletionLog:
    """Owned by the completion stage; `open_input(segment_id)` gives a writable input segment."""

    def __init__(
        self,
        data_dir: DataDir,
        open_input: Callable[[int], Segment],
        result_bytes: int,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.data_dir = data_dir
        self.open_input = open_input
        self.slot_bytes = slot_bytes_for(result_bytes)
        self.segment_bytes = segment_bytes
        self.ids = SegmentIds(data_dir)
        self._jobs: dict[str, _Job] = {}
        self._pending: dict[int, list[np.ndarray]] = defaultdict(
            list
        )  # input segment -> slots marked DEAD

    def load_job(self, job_id: str) -> _Job:
        """The job's state, rebuilt from its completion segments on first use."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        key = SegmentKey(KIND_COMPLETION, job_id)
        job = _Job(
            SegmentAppender(self.data_dir, key, self.slot_bytes, self.segment_bytes, self.ids)
        )
        for path in self.data_dir.completion.glob("out-*.seg"):
            with Segment.open(path) as seg:
                if seg.key.name != job_id:
                    continue
                written = np.flatnonzero(seg.states() != EMPTY)
                good = written[seg.verify(written)]
                job.mark(seg.slots["index"][good].astype(np.int64))
        self._jobs[job_id] = job
        return job

    def completed(self, job_id: str) -> int:
        """Distinct items of the job with a result (or an error result)."""
        return self.load_job(job_id).completed

    def record(self, results: Results) -> Recorded:
        """Store new results durably, then mark their input slots DEAD (durable at the next flush)."""
        job = self.load_job(results.job_id)
        n = len(results.slot)
        index = (results.seq & np.uint64(0xFFFFFFFF)).astype(np.int64)
        keep = np.ones(n, dtype=bool)
        retire = np.zeros(n, dtype=bool)
        refused: list[str] = []
        duplicates = 0
        for segment_id in np.unique(results.segment).tolist():
            mine = results.segment == segment_id
            seg = self.open_input(int(segment_id))
            slots = results.slot[mine].astype(np.int64)
            states = seg.markers[slots] & STATE_MASK
            wrong_seq = seg.slots["seq"][slots] != results.seq[mine]
            bad = (states == EMPTY) | wrong_seq
            for i in np.flatnonzero(bad).tolist():
                refused.append(
                    f"segment {segment_id} slot {int(slots[i])}: seq {int(results.seq[mine][i])} "
                    f"does not match the slot ({'never written' if states[i] == EMPTY else 'another item'})"
                )
            dead = ~bad & (states == DEAD)
            where = np.flatnonzero(mine)
            keep[where[bad | dead]] = False
            retire[where[~bad & (states == LIVE)]] = True
            duplicates += int(dead.sum())
        sizes = np.diff(results.offsets)
        too_big = keep & (sizes > self.slot_bytes - 32)
        for i in np.flatnonzero(too_big).tolist():
            refused.append(
                f"item {int(index[i])}: result of {int(sizes[i])} bytes exceeds its budget"
            )
        keep &= ~too_big
        retire &= ~too_big
        already = keep & job.seen(index)
        duplicates += int(already.sum())
        fresh = np.flatnonzero(keep & ~already)
        _, first = np.unique(
            index[fresh], return_index=True
        )  # one result per item, even in one batch
        fresh = fresh[np.sort(first)]
        if len(fresh):
            width = int(sizes[fresh].max())
            body = np.zeros((len(fresh), width), dtype=np.uint8)
            columns = np.arange(width)[None, :]
            mask = columns < sizes[fresh][:, None]
            starts = results.offsets[fresh][:, None] + columns
            body[mask] = results.payload[starts[mask]]
            job.appender.append(
                results.seq[fresh],
                np.full(len(fresh), results.job_no, np.uint64),
                index[fresh].astype(np.uint32),
                sizes[fresh].astype(np.uint32),
                body,
                results.status[fresh].astype(np.uint32),
            )
            job.appender.sync()  # output durable before any tombstone
            job.mark(index[fresh])
        for segment_id in np.unique(results.segment[retire]).tolist():
            slots = results.slot[retire & (results.segment == segment_id)].astype(np.int64)
            self.open_input(int(segment_id)).tombstone(slots)  # markers, then the deleted count
            self._pending[int(segment_id)].append(slots)
        return Recorded(len(fresh), duplicates, refused)

    def flush_tombstones(self) -> dict[int, np.ndarray]:
        """Make the DEAD markers written since the last flush durable; returns them by segment."""
        done = {}
        for segment_id, parts in self._pending.items():
            self.open_input(segment_id).sync()
            done[segment_id] = np.concatenate(parts)
        self._pending.clear()
        return done

    def close(self) -> None:
        for job in self._jobs.values():
            job.appender.close()
        self._jobs.clear()
