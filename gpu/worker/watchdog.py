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
"""

from __future__ import annotations

import time
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
        self.last_look = 0.0  # monotonic

    def look(self, engine: EngineThread, waiting: list[int]) -> Verdict | None:
        """A verdict, or None while the engine is fine. `waiting`: ids of the batches held
        queued or running."""
        if not engine.is_alive():
            return Verdict(f"the engine thread of {engine.name} ended")
        running, limit = engine.running, self.limit_s
        why = engine.engine.broken()
        if why is not None:
            return Verdict(f"engine {engine.name} is broken: {why}", running and running[0])
        if not limit:
            return None
        if running is None:
            return self._waiting(engine, waiting, limit)
        self.stalled_since = None
        batch_id, began = running
        seconds = time.monotonic() - began
        if seconds < limit:
            return None
        return Verdict(
            f"engine {engine.name} hung: batch {batch_id} ran {seconds:.0f} s, past "
            f"batch_timeout_s = {limit:g}",
            batch_id,
        )

    def _waiting(self, engine: EngineThread, waiting: list[int], limit: float) -> Verdict | None:
        """Nothing runs: batches waiting for the engine longer than `limit` mean it takes none."""
        now = time.monotonic()
        frozen = now - self.last_look > min(WATCH_GAP_S, limit / 2)
        self.last_look = now
        if not waiting:
            self.stalled_since = None
            return None
        if self.stalled_since is None or frozen:  # this process itself did not run meanwhile
            self.stalled_since = now  # (SIGSTOP, a starved host): the engine had no chance
        seconds = now - max(self.stalled_since, engine.active)
        if seconds < limit:
            return None
        return Verdict(
            f"engine {engine.name} takes no work: batch(es) {waiting[:5]} held {seconds:.0f} s "
            f"with none running, past batch_timeout_s = {limit:g}"
        )
