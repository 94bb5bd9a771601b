"""Sessions that report but make no progress: dispatch's defence against work held and never run.

A worker's reports renew its leases (invariant 8), so a worker whose network
thread goes on while nothing runs its batches (a dead engine thread, a bug)
would hold them for ever and its job would never finish. Dispatch does not
trust the worker to notice: it watches each session's progress itself.

| term        | meaning                                                                  |
|-------------|--------------------------------------------------------------------------|
| progress    | results from the session (not a resend); or work handed to it while it held none; or its (re)registration |
| batch time  | the time from one sign of progress to the next results, smoothed over the session's batches: measured here, not reported by the worker |
| stall limit | `stall_batch_multiple` x the batch time, never below `stall_min_s` (the floor also covers a session not measured yet) |
| stalled     | holding batches whose results have not come, with no progress for longer than the stall limit |

A stalled session's unanswered batches are reclaimed (an attempt for each it
may have started, as for a lost session: a batch that hangs its engine every
time ends dead-lettered) and it gets no new work until its results come again.
The session stays registered: `status` and the metrics show it as stalled.
`stall_batch_multiple = 0` turns the watch off.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest batch time in the session's average


@dataclass
class _Progress:
    since: float  # monotonic: the last sign of progress
    batch_s: float | None = None  # the session's measured batch time, smoothed
    stalled: bool = False


@dataclass(frozen=True)
class Stall:
    """A session found stalled: how long without progress, and the limit it passed."""

    session: str
    silent_s: float
    limit_s: float


class StallWatch:
    """Per-session progress clocks; drive it with `now` from time.monotonic()."""

    def __init__(self, multiple: float, min_s: float) -> None:
        self.multiple = multiple
        self.min_s = min_s
        self._sessions: dict[str, _Progress] = {}

    def registered(self, session: str, now: float) -> None:
        """A session (re)registered: its clock starts now; it is not stalled."""
        self._sessions[session] = _Progress(now)

    def handed(self, session: str, now: float, was_idle: bool) -> None:
        """A batch was handed to `session`; the clock starts if it held nothing before."""
        progress = self._sessions.setdefault(session, _Progress(now))
        if was_idle:
            progress.since = now

    def answered(self, session: str, now: float) -> None:
        """Results came from `session`: one batch time measured; not stalled any more."""
        progress = self._sessions.get(session)
        if progress is None:
            self._sessions[session] = _Progress(now)
            return
        took = max(0.0, now - progress.since)
        progress.batch_s = (
            took
            if progress.batch_s is None
            else (1 - SMOOTHING) * progress.batch_s + SMOOTHING * took
        )
        progress.since = now
        progress.stalled = False

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)

    def limit_s(self, session: str) -> float:
        progress = self._sessions.get(session)
        measured = progress.batch_s if progress is not None and progress.batch_s else 0.0
        return max(self.min_s, self.multiple * measured)

    def is_stalled(self, session: str) -> bool:
        progress = self._sessions.get(session)
        return progress is not None and progress.stalled

    def find(self, holding: dict[str, int], now: float) -> list[Stall]:
        """Sessions holding unanswered batches (`holding`: session -> batches) past their
        limit; each is marked stalled (found once until its results come again)."""
        if self.multiple <= 0:
            return []
        found = []
        for session, batches in holding.items():
            progress = self._sessions.get(session)
            if not batches or progress is None or progress.stalled:
                continue
            silent_s, limit_s = now - progress.since, self.limit_s(session)
            if silent_s > limit_s:
                progress.stalled = True
                found.append(Stall(session, silent_s, limit_s))
        return found

    def view(self, session: str, now: float) -> dict:
        """For `status`: seconds since its last progress, its batch time, stalled or not."""
        progress = self._sessions.get(session)
        if progress is None:
            return {"progress_s": None, "batch_s": None, "stalled": False}
        return {
            "progress_s": round(now - progress.since, 1),
            "batch_s": None if progress.batch_s is None else round(progress.batch_s, 3),
            "stalled": progress.stalled,
        }
