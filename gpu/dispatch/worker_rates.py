"""Each worker's measured speed, from the results it sends: items and lane-padded prompt
tokens per second of the time it held work (docs/dispatch.md, "Demand and deadlines").

Dispatch measures it itself, on its own clock (`now`, so a fake one in tests), from what it
sees of every worker whatever its version: each RESULTS message counts its items and their
tokens (items x the batch's lane, as `fabric_queued_tokens` counts the queue), and the time
since the later of the batch's hand-out and the session's previous result. A worker fed
ahead (prefetch) is busy from one result to the next; one that waited for work is not
counted for the wait. The rate is over the results of the last `WINDOW_S`; a session with
none there keeps its last one. A model's per-worker rate is the mean over its sessions that
have one, and the last such mean stays known when its workers leave (a fleet scaled to 0
keeps the speed it measured).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from gpu.dispatch.demand import Rate

WINDOW_S = 30.0  # results older than this leave a session's rate


@dataclass
class SessionMeter:
    model: str
    busy_until: float = -1.0  # the end of the time already counted busy
    done: collections.deque = field(default_factory=collections.deque)  # (t, items, tokens, s)
    rate: Rate | None = None  # from `done`; kept when the window empties


class WorkerRates:
    """Per session: its measured rate; per model: the per-worker rate (single owner)."""

    def __init__(self) -> None:
        self._sessions: dict[str, SessionMeter] = {}
        self._models: dict[str, Rate] = {}  # the last per-worker rate measured per model

    def results(
        self, session: str, model: str, items: int, lane: int, handed_s: float, now: float
    ) -> None:
        """A RESULTS message of `items` items of a batch of lane `lane` handed out at
        `handed_s` (the stage's clock)."""
        meter = self._sessions.get(session)
        if meter is None or meter.model != model:
            meter = self._sessions[session] = SessionMeter(model)
        busy_s = max(0.0, now - max(handed_s, meter.busy_until))
        meter.busy_until = max(meter.busy_until, now)
        meter.done.append((now, items, items * lane, busy_s))
        while meter.done and meter.done[0][0] < now - WINDOW_S:
            meter.done.popleft()
        seconds = sum(entry[3] for entry in meter.done)
        if seconds > 0:
            n = sum(entry[1] for entry in meter.done)
            tokens = sum(entry[2] for entry in meter.done)
            meter.rate = Rate(n / seconds, tokens / seconds)

    def keep_only(self, live: set[str]) -> None:
        """Forget the sessions that left (BYE, silence): their rates no longer count."""
        for session in set(self._sessions) - live:
            del self._sessions[session]

    def of_session(self, session: str) -> Rate | None:
        meter = self._sessions.get(session)
        return None if meter is None else meter.rate

    def per_worker(self, model: str, sessions: list[str]) -> Rate:
        """The model's per-worker rate: the mean over `sessions` (its live ones) that have
        one, else the last mean measured, else unknown (both None)."""
        rates = [r for s in sessions if (r := self.of_session(s)) is not None]
        if rates:
            self._models[model] = Rate(
                sum(r.items_per_s or 0.0 for r in rates) / len(rates),
                sum(r.tokens_per_s or 0.0 for r in rates) / len(rates),
            )
        return self._models.get(model, Rate(None, None))
