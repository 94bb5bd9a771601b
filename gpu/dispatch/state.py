"""The dispatch owner's state: which work is queued, which is out with whom, and until when.

One owner thread holds a `DispatchState`; nothing here is thread-safe and
nothing here does socket I/O. Memory grows with segments and with work in
flight, never with the backlog: per segment a cursor (every slot before it
has been handed out or retired), the written end, a bitmap of slots out on
lease (allocated while any are), and the slots handed back for another try.

A batch is one segment's slots, so it is one model, one shape and one lane.
Choosing the segment: the highest priority class first, then the oldest
segment (ids increase with age). Hints may reorder candidates but never
remove them (invariant 10): `next_batch` falls through to any segment with
work. Earlier job deadlines go first, within a bounded share of the batches
(gpu/dispatch/deadline_order.py). Taking a batch is two-phase (invariant 6):
it first reads every slot it will hand out (markers, checksums, seqs) and
only then commits the lease, the bitmap and the cursor. A slot whose
checksum fails is quarantined, never sent, and reported so the completion
stage can give it an error result.

An item that was reclaimed before (its attempts byte is not 0) is handed
out alone, to a session that holds nothing else and gets nothing else until
that item is resolved, so a poison item that kills its worker takes no
healthy items down with it on the next tries.

How work comes back from a lease (reclaims, expiries, retirements) is in
gpu/dispatch/reclaim.py, mixed into `DispatchState`. Lease times use the
monotonic clock passed in as `now`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from gpu.dispatch.batch import Batch, Outcome, adopted, items_of, quarantined, read_rows
from gpu.dispatch.deadline_order import DeadlineOrder, Deadlines
from gpu.dispatch.leases import Leases
from gpu.dispatch.paused import PausedJobs, free_slots
from gpu.dispatch.reclaim import Reclaiming
from gpu.dispatch.segment_queue import Queued, SegmentQueue
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core import item_seq
from pipeline.store.segment import Segment
from pipeline.store.segment_format import (
    CHECKSUM_WORD,
    slot_checksums,
)


class DispatchState(Reclaiming):
    """Single-owner dispatch state; drive it with `now` from time.monotonic()."""

    def __init__(
        self, lease_s: float, max_attempts: int, deadlines: Deadlines | None = None
    ) -> None:
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        # earlier deadlines first, a hint (gpu/dispatch/deadline_order.py); jobs' from `deadlines`
        self.deadline_order = DeadlineOrder(deadlines) if deadlines is not None else None
        self._work: dict[int, SegmentQueue] = {}
        self.table = Leases()  # which batch is out with whom (gpu/dispatch/leases.py)
        self._next_batch_id = 1
        self._loaded = False
        self.dead_letters: list[np.ndarray] = []
        self.quarantined: list[np.ndarray] = []
        self.cancelled_jobs: set[int] = set()
        self.cancelled: list[np.ndarray] = []
        self.paused = PausedJobs()  # their queued items held back (gpu/dispatch/paused.py)
        if self.deadline_order is not None:  # a paused job is never the pick
            self.deadline_order.paused = self.paused.jobs
        self._swept: dict[int, int] = {}  # segment -> end already swept for cancelled jobs

    # ---- what there is to do -----------------------------------------------------------------
    def add_segment(
        self,
        segment: Segment,
        first_live: int,
        end: int,
        priority: int = 0,
        not_before: float = 0.0,
    ) -> None:
        """Make slots first_live..end of an open (writable) segment dispatchable.

        `not_before` holds the segment back (monotonic seconds): after a start,
        workers that still hold some of its items re-register first (invariant 8).
        """
        work = self._work.get(segment.segment_id)
        if work is None:
            work = SegmentQueue(segment, priority, max(first_live, 0), end, not_before=not_before)
            work.mark_retired_on_disk(work.cursor, end)
            self._work[segment.segment_id] = work
        else:
            work.end = max(work.end, end)

    def knows(self, segment_id: int) -> bool:
        return segment_id in self._work

    def peek_batch_id(self) -> int:
        """The id the next batch will get."""
        return self._next_batch_id

    def set_next_batch_id(self, batch_id: int) -> None:
        """Continue numbering after `batch_id` (ids from reloaded dispatch files stay unique)."""
        self._next_batch_id = max(self._next_batch_id, batch_id + 1)

    def forget_finished(self) -> list[Segment]:
        """Drop segments that are sealed, fully handed out and with no LIVE slot; returns them.

        The caller closes them, releasing their shared locks, so the collector can remove them.
        """
        gone = [work for work in self._work.values() if work.finished()]
        for work in gone:
            del self._work[work.segment.segment_id]
            if self.deadline_order is not None:
                self.deadline_order.forget(work.segment.segment_id)
        return [work.segment for work in gone]

    def queues(self) -> list[SegmentQueue]:
        """Every known segment's queue (read-only use: the demand, gpu/dispatch/demand_view.py)."""
        return list(self._work.values())

    def segments(self) -> list[Segment]:
        return [w.segment for w in self._work.values()]

    def queue_depth(self) -> list[Queued]:
        """Per known segment: the items waiting to be handed out (the one queue-depth
        definition: `status`, `status --watch` and the metrics all show it).

        Waiting: slots from the cursor to the written end that are not out on
        lease, quarantined, dead-lettered, cancelled or retired (after a reclaim
        rewinds the cursor, the slots still on lease past it are not waiting;
        nor is a slot retired past it, nor a cancelled job's, retired or not).
        """
        rows = []
        for work in self._work.values():
            floor = work.cursor
            for batch_id in work.batches or ():
                slots = self.table.by_id[batch_id].items["slot"]
                if len(slots):
                    floor = min(floor, int(slots.min()))
            row = work.queued(floor)
            held = self.paused.held_in(row.segment_id)  # a paused job's items wait
            rows.append(dataclasses.replace(row, waiting=row.waiting + held) if held else row)
        return rows

    def extend(self, segment_id: int, end: int) -> None:
        """A writer appended to a known segment: slots up to `end` exist."""
        self._work[segment_id].end = max(self._work[segment_id].end, end)

    def loaded(self) -> None:
        """Recovery has finished: leases may expire from now on (invariant 9)."""
        self._loaded = True

    def queued_segments(self, model: str | None = None, now: float | None = None) -> list[int]:
        return [
            s
            for s, w in self._work.items()
            if w.has_work()
            and (model is None or w.model == model)
            and (now is None or w.not_before <= now)
        ]

    def next_release(self, now: float) -> float | None:
        """The earliest time after `now` at which a segment held back (`not_before`) with work
        may be handed out, or None."""
        held = [w.not_before for w in self._work.values() if w.not_before > now and w.has_work()]
        return min(held) if held else None

    def cancel_job(self, job_no: int) -> int:
        """Take every queued item of `job_no` out of dispatch; they come back in `take_outcomes`.

        Items out on lease finish (or not) with their worker. Returns the items taken.
        """
        self.cancelled_jobs.add(job_no)
        self.paused.jobs.discard(job_no)
        held = 0
        for segment_id, slots in self.paused.release(job_no):  # out already; now cancelled
            work = self._work.get(segment_id)
            if work is not None:
                seqs = work.segment.slots["seq"][slots]
                self.cancelled.append(items_of(segment_id, slots, seqs))
                held += len(slots)
        self._swept.clear()  # a new job to look for: every queue once more
        return held + self.sweep_cancelled()

    def pause_job(self, job_no: int) -> int:
        """Hold back every queued item of `job_no` (gpu/dispatch/paused.py) until
        `resume_job`; items on lease finish. Returns the items held now."""
        if job_no in self.paused.jobs or job_no in self.cancelled_jobs:
            return 0
        self.paused.jobs.add(job_no)
        held = 0
        for segment_id, work in self._work.items():
            slots = work.unsent_from(work.cursor)
            if not len(slots):
                continue
            seqs = work.segment.slots["seq"][slots]
            mine = item_seq.job_of(seqs) == job_no
            if mine.any():
                work.mark_out(slots[mine])
                self.paused.hold(segment_id, slots[mine], seqs[mine])
                held += int(mine.sum())
        return held

    def resume_job(self, job_no: int) -> int:
        """Give `job_no`'s held items back to the queue (each segment's cursor rewinds to
        the first of them, as a reclaim does). Returns the items given back."""
        self.paused.jobs.discard(job_no)
        back = 0
        for segment_id, slots in self.paused.release(job_no):
            work = self._work.get(segment_id)
            if work is None or work.out is None:
                continue
            work.out[slots] = False
            first = int(slots.min())
            work.cursor = min(work.cursor, first)
            if self.deadline_order is not None:
                self.deadline_order.rewind(segment_id, first)
            back += len(slots)
        return back

    def sweep_cancelled(self) -> int:
        """Take queued items of cancelled jobs written since the last sweep; returns how many."""
        if not self.cancelled_jobs:
            return 0
        jobs = np.fromiter(self.cancelled_jobs, np.int64)
        taken = 0
        for segment_id, work in self._work.items():
            segment = work.segment
            start = max(work.cursor, self._swept.get(segment_id, 0))
            if start >= work.end:
                continue
            self._swept[segment_id] = work.end
            slots = work.unsent_from(start)
            if not len(slots):
                continue
            seqs = segment.slots["seq"][slots]
            mine = np.isin(item_seq.job_of(seqs), jobs)
            if mine.any():
                work.mark_out(slots[mine])
                self.cancelled.append(items_of(segment.segment_id, slots[mine], seqs[mine]))
                taken += int(mine.sum())
        return taken

    # ---- handing work out -----------------------------------------------------------------------
    def next_batch(
        self,
        session: str,
        model: str,
        max_items: int,
        max_tokens: int,
        now: float,
        prefer: Iterable[int] = (),
    ) -> Batch | None:
        """A batch for `session`, or None when the model has no dispatchable work for it."""
        if session in self.table.suspect:
            return None
        candidates = sorted(
            (self._work[s] for s in self.queued_segments(model, now)),
            key=lambda w: (-w.priority, w.segment.segment_id),
        )
        preferred = [w for s in prefer if (w := self._work.get(s)) is not None and w in candidates]
        order = preferred + [w for w in candidates if w not in preferred]
        tries: list[tuple[SegmentQueue, int | None]] = [(work, None) for work in order]
        pick = self.deadline_order.pick(model, order, now) if self.deadline_order else None
        if pick is not None:  # a hint: if it yields nothing, today's order follows
            tries.insert(0, pick)
        for n, (work, start) in enumerate(tries):
            budget = max(1, min(max_items, max_tokens // max(1, work.segment.key.lane)))
            batch = self._take(work, session, budget, now, start)
            if batch is not None:
                if pick is not None and n == 0:
                    self.deadline_order.taken(model)
                return batch
        return None

    def _take(
        self, work: SegmentQueue, session: str, budget: int, now: float, start: int | None = None
    ) -> Batch | None:
        """A batch of `work`'s next free slots from its cursor, or from `start` past it (the
        cursor then stays: the slots before `start` still wait)."""
        segment = work.segment
        ahead = start is not None and start > work.cursor
        # Phase 1: read, check, decide; nothing changes yet.
        # (a paused job's slots met here are held: gpu/dispatch/paused.py)
        slots, scanned_to = free_slots(self.paused, work, budget, start if ahead else None)
        if len(slots) == 0:
            self._passed(work, start if ahead else None, scanned_to)
            return None
        last_try = segment.attempts(slots) >= max(1, self.max_attempts - 1)
        suspect = bool(last_try[0])
        if suspect and self.table.holds_any(session):
            return None  # an item on its last try goes to a worker that holds nothing else
        if last_try.any():  # ... and alone: a poison item sinks no healthy batch-mate
            cut = 1 if suspect else int(np.argmax(last_try))
            slots = slots[:cut]
            scanned_to = int(slots[-1]) + 1
        words = read_rows(segment.words, slots)  # the one copy of the slots, checked as read
        segment.release_slots(int(slots[0]), int(slots[-1]))  # copied: not resident here
        ok = slot_checksums(words) == words[:, CHECKSUM_WORD]
        seqs = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        if self.cancelled_jobs:
            jobs = np.fromiter(self.cancelled_jobs, np.int64)
            gone = np.isin(item_seq.job_of(seqs), jobs) & ok
        else:
            gone = None
        # Phase 2: commit.
        if gone is not None and gone.any():
            self.cancelled.append(items_of(segment.segment_id, slots[gone], seqs[gone]))
            work.mark_out(slots[gone])
            slots, seqs, ok, words = slots[~gone], seqs[~gone], ok[~gone], words[~gone]
        if not ok.all():
            bad = slots[~ok]
            self.quarantined.append(quarantined(segment.segment_id, bad, words[~ok], seqs[~ok]))
            work.mark_out(bad)  # never offered again in this life
            slots, seqs, words = slots[ok], seqs[ok], words[ok]
        self._passed(work, start if ahead else None, scanned_to)
        if len(slots) == 0:
            return None
        work.mark_out(slots)
        batch = Batch.of_slots(
            self._next_batch_id, session, work, slots, seqs, words, self.lease_s, suspect, now
        )
        self._next_batch_id += 1
        self._add_lease(batch, work)
        return batch

    def _passed(self, work: SegmentQueue, start: int | None, scanned_to: int) -> None:
        """Every slot from the cursor (or `start`, past it) to `scanned_to` is taken or out."""
        if start is None:
            work.cursor = max(work.cursor, scanned_to)
        elif self.deadline_order is not None:
            self.deadline_order.passed(work.segment.segment_id, start, scanned_to)

    def _add_lease(self, batch: Batch, work: SegmentQueue) -> None:
        self.table.add(batch)
        if work.batches is None:
            work.batches = set()
        work.batches.add(batch.batch_id)

    def adopt(
        self, session: str, items: np.ndarray, now: float, batch_id: int | None = None
    ) -> np.ndarray:
        """A worker says it holds `items` (ITEM_DTYPE): mark them held by `session` (invariant 8).

        Returns per item: 1 held by this session now, 2 out with another session
        (the worker may finish it; the first result wins), 0 unknown or retired
        (the worker should drop it). Creates one lease per segment.
        """
        answer = np.zeros(len(items), np.uint8)
        for segment_id in np.unique(items["segment"]).tolist():
            mine = np.flatnonzero(items["segment"] == segment_id)
            work = self._work.get(int(segment_id))
            if work is None:
                continue
            slots = items["slot"][mine].astype(np.int64)
            held_by_me = np.zeros(len(mine), bool)
            for held in self.table.by_session.get(session, set()):
                batch = self.table.by_id[held]
                if batch.segment_id == segment_id:
                    held_by_me |= np.isin(slots, batch.items["slot"])
            ok, elsewhere = work.claimed(slots, items["seq"][mine], held_by_me)
            answer[mine[ok]] = 1
            answer[mine[elsewhere]] = 2
            fresh = ok & ~held_by_me & ~elsewhere
            if fresh.any():
                work.mark_out(slots[fresh])
                lease_id = batch_id if batch_id is not None else self._next_batch_id
                self.set_next_batch_id(lease_id)
                batch = adopted(
                    lease_id, session, work.segment, slots[fresh], now + self.lease_s, now
                )
                self._add_lease(batch, work)
        return answer

    def take_ended(self) -> list[int]:
        return self.table.take_ended()

    def take_dropped(self) -> list[tuple[int, np.ndarray]]:
        return self.table.take_dropped()

    def session_batches(self, session: str) -> int:
        """Batches the session holds whose results have not come back yet."""
        return self.table.unanswered(session)

    def answered(self, session: str, batch_id: int) -> None:
        self.table.answered(session, batch_id)

    def sessions(self) -> list[str]:
        return list(self.table.by_session)

    # ---- leases --------------------------------------------------------------------------------
    def renew(self, session: str, now: float) -> int:
        """A session reported in: extend all its leases. Returns how many batches it holds."""
        return self.table.renew(session, now + self.lease_s)

    def take_outcomes(self) -> Outcome:
        """Dead letters, quarantined and cancelled items since the last call."""
        empty = np.zeros(0, ITEM_DTYPE)
        outcome = Outcome(
            np.concatenate(self.dead_letters) if self.dead_letters else empty,
            np.concatenate(self.quarantined) if self.quarantined else empty,
            np.concatenate(self.cancelled) if self.cancelled else empty,
        )
        self.dead_letters, self.quarantined, self.cancelled = [], [], []
        return outcome

    def leases(self, session: str | None = None) -> list[Batch]:
        return list(self.table.by_id.values()) if session is None else self.table.of(session)

    def lease(self, batch_id: int) -> Batch | None:
        return self.table.by_id.get(batch_id)

    @property
    def in_flight(self) -> int:
        return self.table.in_flight
