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
work. Taking a batch is two-phase (invariant 6): it first reads every slot
it will hand out (markers, checksums, seqs) and only then commits the lease,
the bitmap and the cursor. A slot whose checksum fails is quarantined, never
sent, and reported so the completion stage can give it an error result.

Reclaiming (invariant 7) rewinds only the affected segment's cursor to the
earliest reclaimed slot; each reclaim that counts an attempt writes the
marker's attempts byte (a single-byte store, never the whole marker), and
at `max_attempts` the item is dead-lettered instead (invariant 14). Lease
times use the monotonic clock passed in as `now`; nothing expires before
`loaded()` (invariant 9).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipeline.segment import Segment
from pipeline.segment_format import LIVE, STATE_MASK

log = logging.getLogger("fabric.dispatch")

ITEM_DTYPE = np.dtype([("segment", "<u8"), ("slot", "<u4"), ("seq", "<u8")])


@dataclass(eq=False)
class Batch:
    """What a worker gets: one segment's items, ready for the engine."""

    batch_id: int
    session: str
    segment_id: int
    model: str
    shape: int
    lane: int
    items: np.ndarray  # ITEM_DTYPE
    lengths: np.ndarray  # uint32
    tokens: np.ndarray  # uint32 [n, lane]
    deadline_s: float


@dataclass(eq=False)
class Outcome:
    """Items that left dispatch other than by a result: for the completion stage."""

    dead_letters: np.ndarray  # ITEM_DTYPE, reclaimed max_attempts times
    quarantined: np.ndarray  # ITEM_DTYPE, checksum failed


@dataclass(eq=False)
class _Work:
    segment: Segment
    priority: int
    cursor: int
    end: int
    out: np.ndarray | None = None  # bool per slot: on lease now (or quarantined, dead-lettered)

    @property
    def model(self) -> str:
        return self.segment.key.name

    def has_work(self) -> bool:
        return self.cursor < self.end


class DispatchState:
    """Single-owner dispatch state; drive it with `now` from time.monotonic()."""

    def __init__(self, lease_s: float, max_attempts: int) -> None:
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self._work: dict[int, _Work] = {}
        self._leases: dict[int, Batch] = {}
        self._next_batch_id = 1
        self._loaded = False
        self.dead_letters: list[np.ndarray] = []
        self.quarantined: list[np.ndarray] = []

    # ---- what there is to do -----------------------------------------------------------------
    def add_segment(self, segment: Segment, first_live: int, end: int, priority: int = 0) -> None:
        """Make slots first_live..end of an open (writable) segment dispatchable."""
        work = self._work.get(segment.segment_id)
        if work is None:
            self._work[segment.segment_id] = _Work(segment, priority, max(first_live, 0), end)
        else:
            work.end = max(work.end, end)

    def extend(self, segment_id: int, end: int) -> None:
        """A writer appended to a known segment: slots up to `end` exist."""
        self._work[segment_id].end = max(self._work[segment_id].end, end)

    def loaded(self) -> None:
        """Recovery has finished: leases may expire from now on (invariant 9)."""
        self._loaded = True

    def queued_segments(self, model: str | None = None) -> list[int]:
        return [
            s for s, w in self._work.items() if w.has_work() and (model is None or w.model == model)
        ]

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
        """A batch for `session`, or None when the model has no dispatchable work."""
        candidates = sorted(
            (w for w in self._work.values() if w.model == model and w.has_work()),
            key=lambda w: (-w.priority, w.segment.segment_id),
        )
        preferred = [w for s in prefer if (w := self._work.get(s)) is not None and w in candidates]
        for work in preferred + [w for w in candidates if w not in preferred]:
            budget = max(1, min(max_items, max_tokens // max(1, work.segment.key.lane)))
            batch = self._take(work, session, budget, now)
            if batch is not None:
                return batch
        return None

    def _take(self, work: _Work, session: str, budget: int, now: float) -> Batch | None:
        segment = work.segment
        # Phase 1: read, check, decide; nothing changes yet.
        slots, scanned_to = self._candidates(work, budget)
        if len(slots) == 0:
            work.cursor = max(work.cursor, scanned_to)
            return None
        ok = segment.verify(slots)
        seqs = segment.slots["seq"][slots]
        # Phase 2: commit.
        if not ok.all():
            bad = slots[~ok]
            log.error(
                "segment %d: %d slot(s) fail their checksum and are quarantined: %s",
                segment.segment_id,
                len(bad),
                bad[:10].tolist(),
            )
            self.quarantined.append(_items(segment.segment_id, bad, seqs[~ok]))
            self._mark_out(work, bad)  # never offered again in this life
            slots, seqs = slots[ok], seqs[ok]
        work.cursor = max(work.cursor, scanned_to)
        if len(slots) == 0:
            return None
        self._mark_out(work, slots)
        words = segment.words[slots]
        lane = segment.key.lane
        batch = Batch(
            batch_id=self._next_batch_id,
            session=session,
            segment_id=segment.segment_id,
            model=work.model,
            shape=segment.key.shape,
            lane=lane,
            items=_items(segment.segment_id, slots, seqs),
            lengths=segment.slots["count"][slots].astype(np.uint32),
            tokens=np.ascontiguousarray(words[:, 8 : 8 + lane]),
            deadline_s=now + self.lease_s,
        )
        self._next_batch_id += 1
        self._leases[batch.batch_id] = batch
        return batch

    def _candidates(self, work: _Work, budget: int) -> tuple[np.ndarray, int]:
        """Up to `budget` LIVE slots not out on lease, from the cursor; and how far that scanned.

        Every slot before the returned position is out, retired or never
        written, so the cursor may move there once the batch is committed.
        """
        window = work.segment.markers[work.cursor : work.end] & STATE_MASK
        free = window == LIVE
        if work.out is not None:
            free &= ~work.out[work.cursor : work.end]
        found = np.flatnonzero(free)[:budget] + work.cursor
        scanned_to = int(found[-1]) + 1 if len(found) == budget else work.end
        return found.astype(np.int64), scanned_to

    def _mark_out(self, work: _Work, slots: np.ndarray) -> None:
        if work.out is None:
            work.out = np.zeros(work.segment.capacity, dtype=bool)
        work.out[slots] = True

    # ---- leases --------------------------------------------------------------------------------
    def renew(self, session: str, now: float) -> int:
        """A session reported in: extend all its leases. Returns how many batches it holds."""
        held = [b for b in self._leases.values() if b.session == session]
        for batch in held:
            batch.deadline_s = now + self.lease_s
        return len(held)

    def expire(self, now: float) -> int:
        """Reclaim every lease past its deadline (after `loaded()` only); returns items reclaimed."""
        if not self._loaded:
            return 0
        expired = [b for b in self._leases.values() if b.deadline_s < now]
        return sum(self.reclaim(b.batch_id, count_attempt=True) for b in expired)

    def drop_session(self, session: str) -> int:
        """A session is gone: reclaim all it held, counting an attempt for each item."""
        held = [b.batch_id for b in self._leases.values() if b.session == session]
        return sum(self.reclaim(batch_id, count_attempt=True) for batch_id in held)

    def reclaim(self, batch_id: int, count_attempt: bool, slots: np.ndarray | None = None) -> int:
        """Hand a batch (or some of its slots) back. Rewinds only its segment (invariant 7)."""
        batch = self._leases.get(batch_id)
        if batch is None:
            return 0
        work = self._work[batch.segment_id]
        all_slots = batch.items["slot"].astype(np.int64)
        back = all_slots if slots is None else np.intersect1d(all_slots, slots)
        rest = np.setdiff1d(all_slots, back)
        if len(rest):
            batch.items = batch.items[np.isin(all_slots, rest)]
        else:
            del self._leases[batch_id]
        segment = work.segment
        back = back[
            (segment.markers[back] & STATE_MASK) == LIVE
        ]  # retired meanwhile: nothing to do
        if work.out is not None:
            work.out[back] = False
        if count_attempt and len(back):
            attempts = segment.attempts(back).astype(np.int64) + 1
            segment.set_attempts(back, attempts)
            done = attempts >= self.max_attempts
            if done.any():
                dead = back[done]
                self.dead_letters.append(
                    _items(segment.segment_id, dead, segment.slots["seq"][dead])
                )
                self._mark_out(work, dead)  # the completion stage retires them with an error
                log.warning(
                    "segment %d: %d item(s) dead-lettered after %d attempts",
                    segment.segment_id,
                    len(dead),
                    self.max_attempts,
                )
                back = back[~done]
        if len(back):
            work.cursor = min(work.cursor, int(back.min()))  # bounded rewind
        return len(back)

    def retired(self, segment_id: int, slots: np.ndarray) -> None:
        """The completion stage retired these slots (their markers are DEAD)."""
        work = self._work.get(segment_id)
        if work is None:
            return
        if work.out is not None:
            work.out[slots] = False
        for batch in [b for b in self._leases.values() if b.segment_id == segment_id]:
            keep = ~np.isin(batch.items["slot"], slots)
            if not keep.all():
                batch.items = batch.items[keep]
                if len(batch.items) == 0:
                    del self._leases[batch.batch_id]

    def take_outcomes(self) -> Outcome:
        """Dead letters and quarantined items since the last call."""
        empty = np.zeros(0, ITEM_DTYPE)
        outcome = Outcome(
            np.concatenate(self.dead_letters) if self.dead_letters else empty,
            np.concatenate(self.quarantined) if self.quarantined else empty,
        )
        self.dead_letters, self.quarantined = [], []
        return outcome

    def leases(self, session: str | None = None) -> list[Batch]:
        return [b for b in self._leases.values() if session is None or b.session == session]


def _items(segment_id: int, slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    items = np.zeros(len(slots), ITEM_DTYPE)
    items["segment"] = segment_id
    items["slot"] = slots
    items["seq"] = seqs
    return items
