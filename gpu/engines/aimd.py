"""Adaptive concurrency (AIMD): how many requests an engine keeps in flight to its upstream.

The limit grows by one request per round of good answers (each good answer adds `1 / limit`)
and halves when the upstream pushes back: a 429, a 5xx, a connection error, or an answer
slower than `latency_target_s` (0: no target). One push-back halves once: answers to
requests sent before the last halving say nothing new about the halved limit, so they do not
halve it again. The limit stays within [1, maximum].

`acquire()` blocks while `limit` requests are in flight; `release(...)` says how the request
went. Thread-safe: one gate is shared by every thread that talks to the upstream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class AimdGate:
    """Requests in flight, at most `limit`, the limit moved by AIMD (module docstring)."""

    def __init__(
        self,
        maximum: int,
        start: int = 1,
        latency_target_s: float = 0.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.maximum = max(1, int(maximum))
        self.limit = float(min(self.maximum, max(1, int(start))))
        self.latency_target_s = float(latency_target_s)
        self.in_flight = 0
        self.halvings = 0  # how often it backed off (a figure for tests and docs)
        self._halved_at = -1.0  # monotonic time of the last halving
        self._now = now
        self._cond = threading.Condition()

    @property
    def allowed(self) -> int:
        """Requests that may be in flight now."""
        return max(1, int(self.limit))

    def acquire(self, give_up: Callable[[], bool] = lambda: False) -> float | None:
        """Wait for room; the request's start time, or None when `give_up()` turned true."""
        with self._cond:
            while self.in_flight >= self.allowed:
                if give_up():
                    return None
                self._cond.wait(0.05)
            self.in_flight += 1
            return self._now()

    def release(self, started: float, ok: bool) -> None:
        """One request started at `started` ended: `ok` when the upstream answered well
        (a 2xx or an item's own 4xx), False when it pushed back."""
        with self._cond:
            self.in_flight -= 1
            slow = self.latency_target_s > 0 and self._now() - started > self.latency_target_s
            if ok and not slow:
                self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)
            elif started >= self._halved_at:  # news since the last halving
                self.limit = max(1.0, self.limit / 2)
                self._halved_at = self._now()
                self.halvings += 1
            self._cond.notify_all()
