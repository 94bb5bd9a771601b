"""The lease table: which batch is out with which session, until when.

Owned by DispatchState (gpu/dispatch/state.py), which decides what goes out
and what comes back; this table only keeps the answer, indexed both ways,
and what the dispatch file must hear of (leases ended, slots dropped from a
lease that goes on). A session with a `suspect` lease holds one item on its
last try and gets nothing else until it is resolved.
"""

from __future__ import annotations

import numpy as np

from gpu.dispatch.batch import Batch


class Leases:
    def __init__(self) -> None:
        self.by_id: dict[int, Batch] = {}
        self.by_session: dict[str, set[int]] = {}
        self.suspect: dict[str, int] = {}  # session -> its lease of one item on its last try
        self.ended: list[int] = []  # leases ended since take_ended()
        self.dropped: list[tuple[int, np.ndarray]] = []  # (lease, slots) left a lease that goes on

    def add(self, batch: Batch) -> None:
        self.by_id[batch.batch_id] = batch
        if batch.suspect:
            self.suspect[batch.session] = batch.batch_id
        self.by_session.setdefault(batch.session, set()).add(batch.batch_id)

    def remove(self, batch: Batch) -> None:
        self.by_id.pop(batch.batch_id, None)
        self.ended.append(batch.batch_id)
        if batch.suspect and self.suspect.get(batch.session) == batch.batch_id:
            del self.suspect[batch.session]
        held = self.by_session.get(batch.session)
        if held is not None:
            held.discard(batch.batch_id)
            if not held:
                del self.by_session[batch.session]

    def of(self, session: str) -> list[Batch]:
        """The session's leases, oldest batch id first."""
        return [self.by_id[b] for b in sorted(self.by_session.get(session, ()))]

    def holds_any(self, session: str) -> bool:
        return bool(self.by_session.get(session))

    def unanswered(self, session: str) -> int:
        """Batches the session holds whose results have not come back yet."""
        return sum(1 for b in self.by_session.get(session, ()) if not self.by_id[b].answered)

    def answered(self, session: str, batch_id: int) -> None:
        """The session sent the results of `batch_id`: it no longer counts against its budget,
        and if it was the session's last-try item, the worker lived through it."""
        batch = self.by_id.get(batch_id)
        if batch is not None and batch.session == session:
            batch.answered = True
            if self.suspect.get(session) == batch_id:
                del self.suspect[session]

    def renew(self, session: str, deadline_s: float) -> int:
        """Move every lease of the session to `deadline_s`; how many it holds."""
        held = self.of(session)
        for batch in held:
            batch.deadline_s = deadline_s
        return len(held)

    def take_ended(self) -> list[int]:
        """Ids of leases that ended (all their items retired or reclaimed) since the last call."""
        ended, self.ended = self.ended, []
        return ended

    def take_dropped(self) -> list[tuple[int, np.ndarray]]:
        """(lease id, slots) reclaimed from leases that go on, since the last call."""
        dropped, self.dropped = self.dropped, []
        return dropped

    @property
    def in_flight(self) -> int:
        return sum(len(b.items) for b in self.by_id.values())
