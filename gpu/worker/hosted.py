"""A worker session hosted on a thread of another process: a Ray actor's (assembly/ray_fleet.py).

`run.py worker` is a process of its own that drains on SIGTERM. A process that hosts a
worker among other things (a Ray actor answers its controller on its main thread) cannot
take SIGTERM for it: it runs the same `Worker` on a thread of its own, and `drain()` asks it
to stop the way SIGTERM asks `run.py worker`: stop asking, hand back the queued batches,
finish the running one within `drain_s`, wait for its results' acks, say BYE.

| `state()["state"]` | meaning                                                        |
|--------------------|----------------------------------------------------------------|
| `starting`         | loading the engine, opening the sockets                        |
| `running`          | asking for work and running it                                 |
| `draining`         | told to stop: finishing or handing back what it holds          |
| `stopped`          | drained: holds nothing, said BYE (the host may go)             |
| `failed`           | the engine broke or would not start: what it held went back (exit code 7 or 10 of `run.py worker`) |
"""

from __future__ import annotations

import logging
import os
import threading
import time

from gpu.engines.base import Engine
from gpu.worker.options import WorkerOptions
from gpu.worker.session import Worker
from pipeline.core import exitcodes

log = logging.getLogger("fabric.worker")


class HostedWorker:
    """One worker session on its own thread; `drain()` stops it, `state()` says how it is."""

    def __init__(self, options: WorkerOptions, engine: Engine) -> None:
        self.options = options
        self.worker = Worker(options, engine)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._state = "starting"
        self._reason = ""
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="fabric-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.worker.open()  # loads the engine: minutes for a large model
        except Exception as exc:  # an engine that cannot start: nothing was leased yet
            self.worker.engine_thread.close()  # its wake pipe (never started), the engine
            self._end("failed", exitcodes.ENGINE_CANNOT_START, f"engine did not start: {exc}")
            return
        self._state = "draining" if self._stop.is_set() else "running"
        try:
            code = self.worker.run(self._stop.is_set)
        except Exception as exc:  # a bug of the session itself: what it held comes back by
            log.exception("the worker session failed")  # the broker's session timeout
            code, self._reason = exitcodes.FAILED, f"worker session failed: {exc}"
        finally:
            self.worker.close()
        if code == exitcodes.OK:
            self._end("stopped", code, "drained")
        else:
            self._end("failed", code, self._reason or f"engine failed: {self.worker.broken}")

    def _end(self, state: str, code: int, reason: str) -> None:
        self.exit_code, self._reason, self._state = code, reason, state
        if state == "failed":
            log.error("worker session %s ended: %s", self.worker.session, reason)

    def drain(self) -> str:
        """Stop as SIGTERM stops `run.py worker`; returns the state (poll `state()` for
        `stopped`)."""
        self._stop.set()
        if self._state == "running":
            self._state = "draining"
        return self._state

    def state(self) -> dict:
        """How the session is: its state (module docstring), session id, items completed,
        seconds idle (waiting for work) and alive, and the host's pid."""
        worker = self.worker
        now = time.monotonic()
        return {
            "state": self._state,
            "session": worker.session,
            "model": self.options.model,
            "completed": worker.completed,
            "idle_s": round(worker.idle_seconds(now), 3),
            "age_s": round(now - self.started, 3),
            "exit_code": self.exit_code,
            "reason": self._reason,
            "pid": os.getpid(),
        }
