"""How work comes back from a lease: reclaimed to the queue, or retired for good.

| how                       | called on                                   | attempt counted            |
|---------------------------|---------------------------------------------|----------------------------|
| `report`                  | a REPORT that no longer lists some items     | yes                        |
| `expire`                  | leases past their deadline (after `loaded()`) | if the batch may have started |
| `drop_session`            | a session gone silent                        | if the batch may have started |
| `reclaim_unanswered`      | a stalled session (gpu/dispatch/stall.py)    | if the batch may have started |
| `drop_session_quietly`    | BYE: a session that left cleanly             | no                         |
| `reclaim`                 | each of the above; HAND_BACK; refused results | as the caller says        |
| `retired`                 | RETIRED from completion: done for good       | (not a reclaim)            |

Reclaiming (invariant 7) rewinds only the affected segment's cursor to the
earliest reclaimed slot; each reclaim that counts an attempt writes the
marker's attempts byte (a single-byte store, never the whole marker), and
at `max_attempts` the item is dead-lettered instead (invariant 14). Lease
times use the monotonic clock passed in as `now`; nothing expires before
`loaded()` (invariant 9).

`Reclaiming` is mixed into `DispatchState` (gpu/dispatch/state.py), the one
owner of the queues and the lease table it works on; like it, nothing here
is thread-safe and nothing here does socket I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from gpu.dispatch.batch import Batch, items_of
from gpu.dispatch.deadline_order import DeadlineOrder
from gpu.dispatch.leases import Leases
from gpu.dispatch.segment_queue import SegmentQueue
from pipeline.store.segment_format import live_markers

log = logging.getLogger("fabric.dispatch")


class Reclaiming:
    """The end of leases, on the fields of a `DispatchState`."""

    # set by DispatchState.__init__
    lease_s: float
    max_attempts: int
    deadline_order: DeadlineOrder | None
    _work: dict[int, SegmentQueue]
    table: Leases
    _loaded: bool
    dead_letters: list[np.ndarray]

    def _remove_lease(self, batch: Batch) -> None:
        self.table.remove(batch)
        work = self._work.get(batch.segment_id)
        if work is not None and work.batches is not None:
            work.batches.discard(batch.batch_id)

    def report(
        self,
        session: str,
        held: np.ndarray,
        seen_batch: int,
        now: float,
        queued: Iterable[int] = (),
    ) -> int:
        """A session's periodic report: renew its leases; reclaim at once what it no longer holds.

        Only batches up to `seen_batch` (the newest the worker had received when
        it wrote the report) are compared, so a batch still on its way is not
        mistaken for a lost one. Returns the items reclaimed.
        """
        reclaimed = 0
        not_started = set(queued)
        for batch_id in sorted(self.table.by_session.get(session, set())):
            batch = self.table.by_id[batch_id]
            batch.deadline_s = now + self.lease_s
            if batch_id > seen_batch:
                continue
            batch.started = batch_id not in not_started
            mine = held["segment"] == batch.segment_id
            missing = ~np.isin(batch.items["slot"], held["slot"][mine])
            if missing.any():
                lost = batch.items["slot"][missing].astype(np.int64)
                log.warning(
                    "session %s no longer holds %d item(s) of batch %d; reclaimed",
                    session,
                    len(lost),
                    batch_id,
                )
                reclaimed += self.reclaim(batch_id, count_attempt=True, slots=lost)
        return reclaimed

    def drop_session_quietly(self, session: str) -> int:
        """A session left cleanly: hand back whatever it still holds without counting attempts."""
        held = [b.batch_id for b in self.table.of(session)]
        return sum(self.reclaim(batch_id, count_attempt=False) for batch_id in held)

    def reclaim_unanswered(self, session: str) -> int:
        """A stalled session (gpu/dispatch/stall.py): reclaim its batches whose results have
        not come, counting an attempt for each it may have started (as for a lost session)."""
        held = self.table.of(session)
        return sum(
            self.reclaim(b.batch_id, count_attempt=b.started) for b in held if not b.answered
        )

    def expire(self, now: float) -> int:
        """Reclaim every lease past its deadline (after `loaded()` only); returns items reclaimed."""
        if not self._loaded:
            return 0
        expired = [b for b in self.table.by_id.values() if b.deadline_s < now]
        return sum(self.reclaim(b.batch_id, count_attempt=b.started) for b in expired)

    def drop_session(self, session: str) -> int:
        """A session is gone: reclaim all it held, counting an attempt for each item it may
        have started (its last report said which batches were still queued, untouched)."""
        held = self.table.of(session)
        return sum(self.reclaim(b.batch_id, count_attempt=b.started) for b in held)

    def reclaim(self, batch_id: int, count_attempt: bool, slots: np.ndarray | None = None) -> int:
        """Hand a batch (or some of its slots) back. Rewinds only its segment (invariant 7)."""
        batch = self.table.by_id.get(batch_id)
        if batch is None:
            return 0
        work = self._work[batch.segment_id]
        all_slots = batch.items["slot"].astype(np.int64)
        back = all_slots if slots is None else np.intersect1d(all_slots, slots)
        rest = np.setdiff1d(all_slots, back)
        if len(rest):
            batch.items = batch.items[np.isin(all_slots, rest)]
            self.table.dropped.append((batch_id, back))
        else:
            self._remove_lease(batch)
        segment = work.segment
        back = back[live_markers(segment.markers[back])]  # retired meanwhile: nothing to do
        if work.out is not None:
            work.out[back] = False
        if count_attempt and len(back):
            attempts = segment.attempts(back).astype(np.int64) + 1
            segment.set_attempts(back, attempts)
            done = attempts >= self.max_attempts
            if done.any():
                dead = back[done]
                self.dead_letters.append(
                    items_of(segment.segment_id, dead, segment.slots["seq"][dead])
                )
                work.mark_out(dead)  # the completion stage retires them with an error
                log.warning(
                    "segment %d: %d item(s) dead-lettered after %d attempts",
                    segment.segment_id,
                    len(dead),
                    self.max_attempts,
                )
                back = back[~done]
        if len(back):
            work.cursor = min(work.cursor, int(back.min()))  # bounded rewind
            if self.deadline_order is not None:
                self.deadline_order.rewind(segment.segment_id, int(back.min()))
        return len(back)

    def retired(self, segment_id: int, slots: np.ndarray) -> None:
        """The completion stage retired these slots (their markers are DEAD): out for good, so
        they never count as waiting again (a cancelled job's items behind the cursor did)."""
        work = self._work.get(segment_id)
        if work is None:
            return
        work.mark_out(slots)
        for batch_id in sorted(work.batches or ()):
            batch = self.table.by_id[batch_id]
            keep = ~np.isin(batch.items["slot"], slots)
            if not keep.all():
                batch.items = batch.items[keep]
                if len(batch.items) == 0:
                    self._remove_lease(batch)
