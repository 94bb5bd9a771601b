"""What the broker's probe paths answer: `GET /live` and `GET /ready` on `metrics.bind`.

An orchestrator (a Kubernetes liveness and readiness probe, a load balancer's
health check) cannot speak the heartbeat port's ZeroMQ; these two plain HTTP
answers say the same things the supervisor knows, from the same process:

| path     | 200 when                                                      | 503 when                         |
|----------|---------------------------------------------------------------|----------------------------------|
| `/live`  | the supervisor is starting (recovery), stopping, or its loop  | its loop has not turned for      |
|          | turned within LOOP_STALE_S (it turns at least every second)   | LOOP_STALE_S: it is stuck        |
| `/ready` | recovery is done, every critical stage (all but local         | recovering, a critical stage     |
|          | workers) is up now, and the broker is not stopping            | starting or restarting, stopping |

A local worker (not critical: restarted for ever) neither delays nor ends
readiness: while its engine loads (minutes for vLLM) or after it died,
producers, remote workers and results clients are served. So `/ready` may
answer 200 before stderr's `fabric: ready` line, which waits for local
workers too. The body is one line for people (`ready`, `not ready: stage
dispatch-0 not up`); programs read the status code. The supervisor's loop feeds `Health`
(pipeline/process/supervisor.py); the metrics thread's HTTP server answers
from it (pipeline/telemetry/metrics_server.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

LOOP_STALE_S = 30.0  # the loop turns at least every second; this long without a turn = stuck
PROBE_PATHS = ("/live", "/ready")

STARTING, SERVING, STOPPING = "starting", "serving", "stopping"


class Health:
    """The supervisor's liveness and readiness, set by its loop, read by the HTTP thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._phase = STARTING
        self._turned_at: float | None = None
        self._not_up: tuple[str, ...] = ()

    def turned(self, not_up: Iterable[str]) -> None:
        """One turn of the supervisor's loop, with the critical stages that are not up now
        (starting, or restarting after a death)."""
        with self._lock:
            if self._phase == STARTING:
                self._phase = SERVING
            self._turned_at = self._clock()
            self._not_up = tuple(not_up)

    def stopping(self) -> None:
        """The supervisor is stopping its stages: not ready, still alive."""
        with self._lock:
            self._phase = STOPPING

    def live(self) -> tuple[bool, str]:
        """(alive, one line saying why)."""
        with self._lock:
            if self._phase != SERVING or self._turned_at is None:
                return True, f"alive: {self._phase}"
            stale_s = self._clock() - self._turned_at
        if stale_s > LOOP_STALE_S:
            return False, (
                f"not alive: the supervisor's loop has not turned for {stale_s:.0f} s "
                f"(limit {LOOP_STALE_S:.0f} s)"
            )
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        """(ready, one line saying why not)."""
        with self._lock:
            if self._phase == STARTING:
                return False, "not ready: starting (recovery, then the stages)"
            if self._phase == STOPPING:
                return False, "not ready: stopping"
            if self._not_up:
                return False, f"not ready: stage {', '.join(self._not_up)} not up"
        return True, "ready"

    def answer(self, path: str) -> tuple[bool, str]:
        """The answer for one of PROBE_PATHS."""
        return self.live() if path == "/live" else self.ready()


def with_probes(health: Health, app: Callable) -> Callable:
    """A WSGI app answering PROBE_PATHS from `health` and every other path with `app`."""

    def probes(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in PROBE_PATHS:
            return app(environ, start_response)
        ok, why = health.answer(path)
        body = f"{why}\n".encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        headers = [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
        ]
        start_response(status, headers)
        return [body]

    return probes
