"""The engine watchdog: a worker never holds work it cannot run.

| what it sees                                            | verdict                    |
|---------------------------------------------------------|----------------------------|
| the engine thread ended                                 | ended (no batch named)     |
| the engine says it is broken (`Engine.broken`: vLLM's engine process died, and vLLM's client waits on it for ever) | broken (the running batch counts an attempt) |
| a batch running past `batch_timeout_s`                  | hung (that batch counts an attempt) |
| batches held, none running, for `batch_timeout_s`       | takes no work              |

A verdict ends the worker (`Worker._fail`: hand back, BYE, exit 7). When
the watchdog itself did not run for `WATCH_GAP_S` (the process was stopped:
SIGSTOP, a starved host), the waiting clock restarts: the engine had no
chance either. `batch_timeout_s = 0` leaves only the first check.

Its clock is the `now` of each look (the session's step): the engine thread
stamps no time, it counts its turns (`EngineThread.turns`, `running`), and
the watchdog times a batch from the first look that sees it running, and
the engine's last start or end from the first look that sees the turn. A
look comes within `IDLE_WAIT_MS` (100 ms) of either, since an ended batch
wakes the session: so on the host's clock a timeout is at most that late,
and on a test's fake clock it comes exactly at `batch_timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.worker.engine_thread import EngineThread

WATCH_GAP_S = 1.0  # the watchdog not run this long: the process was stopped; its clock restarts


@dataclass(frozen=True)
class Verdict:
    reason: str
    batch_id: int | None = None  # the batch the engine hung on (it counts an attempt)


class Watchdog:
    def __init__(self, batch_timeout_s: float) -> None:
        self.limit_s = batch_timeout_s
        self.stalled_since: float | None = None  # batches held, none running, since then
        self.last_look = 0.0
        self.turns = 0  # the engine's turns at the last look
        self.active = 0.0  # the first look that saw the engine start or end a batch
        self.run: tuple[int, int] | None = None  # the run seen going: (its turn, batch id)
        self.run_since = 0.0  # the first look that saw it

    def look(self, engine: EngineThread, waiting: list[int], now: float) -> Verdict | None:
        """A verdict at `now`, or None while the engine is fine. `waiting`: ids of the batches
        held queued or running."""
        if not engine.is_alive():
            return Verdict(f"the engine thread of {engine.name} ended")
        running, turns, limit = engine.running, engine.turns, self.limit_s
        if turns != self.turns:
            self.turns, self.active = turns, now
        if running != self.run:
            self.run, self.run_since = running, now
        why = engine.engine.broken()
        if why is not None:
            return Verdict(f"engine {engine.name} is broken: {why}", running and running[1])
        if not limit:
            return None
        if running is None:
            return self._waiting(engine, waiting, limit, now)
        self.stalled_since = None
        _, batch_id = running
        seconds = now - self.run_since
        if seconds < limit:
            return None
        return Verdict(
            f"engine {engine.name} hung: batch {batch_id} ran {seconds:.0f} s, past "
            f"batch_timeout_s = {limit:g}",
            batch_id,
        )

    def _waiting(
        self, engine: EngineThread, waiting: list[int], limit: float, now: float
    ) -> Verdict | None:
        """Nothing runs: batches waiting for the engine longer than `limit` mean it takes none."""
        frozen = now - self.last_look > min(WATCH_GAP_S, limit / 2)
        self.last_look = now
        if not waiting:
            self.stalled_since = None
            return None
        if self.stalled_since is None or frozen:  # this process itself did not run meanwhile
            self.stalled_since = now  # (SIGSTOP, a starved host): the engine had no chance
        seconds = now - max(self.stalled_since, self.active)
        if seconds < limit:
            return None
        return Verdict(
            f"engine {engine.name} takes no work: batch(es) {waiting[:5]} held {seconds:.0f} s "
            f"with none running, past batch_timeout_s = {limit:g}"
        )
