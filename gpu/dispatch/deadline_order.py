"""Deadline order: higher priority, then least slack first, as a hint that never starves
other work.

Slack is a job's time left less its own work left (in seconds at its model's workers, from
the demand estimate: gpu/dispatch/demand_view.py sets `lead_s`), so a long job with a near
deadline goes ahead of a short one with a nearer deadline that is safe anyway. A job whose
work is not measured yet (no worker rate) ranks by its deadline alone; below, "deadline"
means this slack key.

Today's order (gpu/dispatch/state.py) takes a model's segments highest shape
priority first, then oldest, each from its cursor. When some unfinished job
has a deadline (gpu/dispatch/deadlines.py), `DeadlineOrder.pick` looks at the
same candidates for the waiting job with the earliest deadline and names the
segment and the slot to start from: that job's first slot not handed out
yet, which may lie past the cursor (the slots before it stay queued, and the
cursor stays where it is). The choice is per batch: the batch is the next
free slots from there, whatever job they belong to. Jobs without a deadline
rank after every job with one; equal deadlines go in today's order. A job's
priority (an integer, default 0, gpu/dispatch/deadlines.py) ranks before its
deadline: the waiting job of the highest priority goes first, the earliest
deadline among those, so priority is served by the same hint and the same
bounded share below.

The rule that keeps it a hint (invariant 10): per model, at most
`DEADLINE_RUN` batches in a row may go out of today's order for a deadline;
the next one is taken in today's order, so work without a deadline (or with
a later one, or a lower priority) gets at least one batch in
`DEADLINE_RUN + 1` while deadline or priority work waits, and is never
starved: that batch is the oldest waiting work of the model's first segment
in today's order (the minimum share, docs/dispatch.md). A batch where both orders agree counts for
neither. If the deadline choice yields nothing, dispatch falls through to
today's order.

Which jobs wait in a segment is learnt from the slots themselves: each
segment's `JobSpans` reads the seq (so the job number) of the slots it has
not read yet, at most `SCAN_SLOTS` per choice, in one vectorised pass, and
keeps per job its first slot still to look at and its last slot seen. The
pages read are released again (pipeline/store/segment.py `release_slots`). Memory
is per job with items past a segment's cursor, never per item; nothing of
this is read while no unfinished job has a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gpu.dispatch.segment_queue import SegmentQueue
from pipeline.core import item_seq
from pipeline.store.segment import Segment

NO_SLOT = np.iinfo(np.int64).max
SCAN_SLOTS = 1 << 16  # slots whose job is read per segment per choice
DEADLINE_RUN = 3  # batches in a row a deadline may take out of today's order (then one in it)


class Deadlines(Protocol):
    """What the spans ask of gpu/dispatch/deadlines.py (tests may pass their own)."""

    def any(self) -> bool: ...

    def of(self, job_nos: np.ndarray, now: float) -> np.ndarray: ...

    def priorities(self, job_nos: np.ndarray) -> np.ndarray: ...


class JobSpans:
    """The jobs with items in one segment from the cursor on, and their deadlines."""

    def __init__(self) -> None:
        self.read_to = 0  # slots below this have had their job read
        self.jobs = np.zeros(0, np.int64)
        self.first = np.zeros(0, np.int64)  # per job: its first slot still to look at
        self.last = np.zeros(0, np.int64)  # per job: its last slot read
        self.deadline = np.zeros(0, np.float64)  # inf: none; nan: not known yet
        self._lowest_last = NO_SLOT  # the least of `last`: no job to drop before the cursor passes
        self._unknown = False  # some deadline is nan
        self._timed = False  # some deadline is a time

    def _changed(self) -> None:
        self._lowest_last = int(self.last.min()) if len(self.last) else NO_SLOT
        self._unknown = bool(np.isnan(self.deadline).any())
        self._timed = bool(np.isfinite(self.deadline).any())

    def learn(
        self, segment: Segment, cursor: int, end: int, deadlines: Deadlines, now: float
    ) -> None:
        """Read the jobs of up to SCAN_SLOTS more slots; drop jobs the cursor has passed."""
        start = max(self.read_to, cursor)
        stop = min(end, start + SCAN_SLOTS)
        if stop > start:
            jobs = item_seq.job_of(segment.slots["seq"][start:stop]).astype(np.int64)
            segment.release_slots(start, stop - 1)  # read for the job number only
            found, first = np.unique(jobs, return_index=True)
            _, from_end = np.unique(jobs[::-1], return_index=True)
            last = len(jobs) - 1 - from_end
            known = found > 0  # an unwritten slot reads job 0
            self._merge(found[known], first[known] + start, last[known] + start)
            self.read_to = stop
            self._changed()
        if cursor > self._lowest_last:
            keep = self.last >= cursor
            self.jobs, self.first = self.jobs[keep], self.first[keep]
            self.last, self.deadline = self.last[keep], self.deadline[keep]
            self._changed()
        if self._unknown:
            unknown = np.isnan(self.deadline)
            self.deadline[unknown] = deadlines.of(self.jobs[unknown], now)
            self._changed()

    def _merge(self, jobs: np.ndarray, first: np.ndarray, last: np.ndarray) -> None:
        both = np.concatenate([self.jobs, jobs])
        self.jobs, inverse = np.unique(both, return_inverse=True)
        n = len(self.jobs)
        merged_first = np.full(n, NO_SLOT)
        merged_last = np.full(n, -1, np.int64)
        deadline = np.full(n, np.nan)
        np.minimum.at(merged_first, inverse, np.concatenate([self.first, first]))
        np.maximum.at(merged_last, inverse, np.concatenate([self.last, last]))
        np.fmin.at(deadline, inverse, np.concatenate([self.deadline, np.full(len(jobs), np.nan)]))
        self.first, self.last, self.deadline = merged_first, merged_last, deadline

    def earliest(
        self, cursor: int, priorities: np.ndarray, paused: np.ndarray, lead_s: np.ndarray
    ) -> tuple[tuple, int] | None:
        """((-priority, slack key), slot to start from) of the first waiting job: the highest
        priority (`priorities`, per job of `jobs`), then the least slack (its deadline less
        `lead_s`, the job's own work in seconds); None when no job with a deadline or a
        priority waits here. Jobs in `paused` do not wait."""
        ranked = priorities.any()
        if not self._timed and not ranked:
            return None
        begin = np.maximum(self.first, cursor)
        known = np.isfinite(self.deadline) | (ranked & ~np.isnan(self.deadline))
        waiting = (self.last >= begin) & known
        if len(paused):
            waiting &= ~np.isin(self.jobs, paused)
        if not waiting.any():
            return None
        rows = np.flatnonzero(waiting)
        slack = self.deadline[rows] - lead_s[rows]  # the common `now` cancels out
        order = np.lexsort((begin[rows], slack, -priorities[rows]))
        row = rows[order[0]]
        return (-int(priorities[row]), float(slack[order[0]])), int(begin[row])

    def passed(self, start: int, scanned_to: int) -> None:
        """Every slot of start..scanned_to-1 is out or retired now: jobs look on from there."""
        inside = (self.first >= start) & (self.first < scanned_to)
        self.first[inside] = scanned_to  # a job that begins before `start` keeps its place

    def rewind(self, slot: int) -> None:
        """Slots from `slot` came back (a reclaim): they are read again, and a job found
        among them takes its place back there (`learn` merges the least first slot; a job
        dropped when the cursor passed it is back). A job not among them keeps its place:
        moving every later job back to `slot` made its pick start at the cursor, which reads
        as today's order, so the oldest job got every batch until the cursor reached it."""
        self.read_to = min(self.read_to, slot)


class DeadlineOrder:
    """The deadline hint of one DispatchState: what to take ahead of today's order, and each
    segment's JobSpans (made when a choice first looks at the segment)."""

    def __init__(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines
        self._spans: dict[int, JobSpans] = {}  # segment id -> its jobs past the cursor
        self._run: dict[str, int] = {}  # model -> batches in a row taken ahead of today's order
        self.batches = 0  # batches handed out ahead of today's order (metrics)
        self.paused: set[int] = set()  # jobs whose items are held back (DispatchState's)
        # job number -> its own work left in seconds at its model's workers (the demand's,
        # gpu/dispatch/demand_view.py): the slack order; a job not in it ranks by deadline
        self.lead_s: dict[int, float] = {}

    def pick(
        self, model: str, order: Sequence[SegmentQueue], now: float
    ) -> tuple[SegmentQueue, int] | None:
        """(queue, start slot) to try before `order` (today's order), or None: no deadline
        waits, both orders agree, or today's order has its turn (DEADLINE_RUN)."""
        if not order or not self.deadlines.any():
            return None
        pick = self._earliest(order, now)
        if pick is None or (pick[0] is order[0] and pick[1] <= order[0].cursor):
            return None
        if self._run.get(model, 0) >= DEADLINE_RUN:
            self._run[model] = 0  # this batch goes in today's order
            return None
        return pick

    def taken(self, model: str) -> None:
        """The pick yielded a batch."""
        self._run[model] = self._run.get(model, 0) + 1
        self.batches += 1

    def passed(self, segment_id: int, start: int, scanned_to: int) -> None:
        """A take from `start` (past the cursor) scanned to `scanned_to` (JobSpans.passed)."""
        spans = self._spans.get(segment_id)
        if spans is not None:
            spans.passed(start, scanned_to)

    def rewind(self, segment_id: int, slot: int) -> None:
        """A reclaim gave back slots from `slot` (JobSpans.rewind)."""
        spans = self._spans.get(segment_id)
        if spans is not None:
            spans.rewind(slot)

    def forget(self, segment_id: int) -> None:
        """The segment is finished and released."""
        self._spans.pop(segment_id, None)

    def _earliest(
        self, candidates: Sequence[SegmentQueue], now: float
    ) -> tuple[SegmentQueue, int] | None:
        """(queue, start slot) for the earliest-deadline waiting job among `candidates`
        (in today's order, which breaks ties); None when none has a deadline."""
        best = None
        paused = np.fromiter(self.paused, np.int64, len(self.paused))
        for work in candidates:
            spans = self._spans.get(work.segment.segment_id)
            if spans is None:
                spans = self._spans[work.segment.segment_id] = JobSpans()
            spans.learn(work.segment, work.cursor, work.end, self.deadlines, now)
            priorities = self.deadlines.priorities(spans.jobs)
            lead_s = np.array([self.lead_s.get(j, 0.0) for j in spans.jobs.tolist()])
            found = spans.earliest(work.cursor, priorities, paused, lead_s.reshape(-1))
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], work, found[1])
        return None if best is None else (best[1], best[2])
