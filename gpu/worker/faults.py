"""Fault injection for tests: the worker option `fault = "phase[:n]"` (`run.py worker --fault
phase[:n]`, `WorkerOptions.fault`) SIGKILLs the worker process the n-th time it reaches that
phase (default the first). Only a test passes it; nothing reads the environment.

| phase            | where                                                   |
|------------------|---------------------------------------------------------|
| `before_compute` | the engine thread took a batch, before the engine runs it |
| `mid_batch`      | 2 ms into the engine's run                              |
| `before_send`    | results built, before RESULTS is sent                   |
| `before_ack`     | RESULTS sent, before the acknowledgement                |
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from pipeline.core.errors import FabricError

PHASES = ("before_compute", "mid_batch", "before_send", "before_ack")
log = logging.getLogger("fabric.worker")


class Faults:
    """The plan `spec` gives ("": none, and every call does nothing)."""

    def __init__(self, spec: str = "") -> None:
        self.phase: str | None = None
        self.count = 0
        self.seen: dict[str, int] = {}
        if spec:
            phase, _, count = spec.partition(":")
            if phase not in PHASES:
                raise FabricError(
                    f"worker fault {spec!r} (--fault): the phase must be one of {', '.join(PHASES)}"
                )
            self.phase, self.count = phase, int(count or 1)

    def reached(self, phase: str) -> None:
        """SIGKILL this process if the plan says so at this phase."""
        if self.phase != phase:
            return
        seen = self.seen[phase] = self.seen.get(phase, 0) + 1
        if seen >= self.count:
            log.warning("fault injection: SIGKILL at %s", phase)
            os.kill(os.getpid(), signal.SIGKILL)

    def during_batch(self) -> None:
        """Arm `mid_batch` to fire while the engine runs the batch it is starting."""
        if self.phase == "mid_batch":
            threading.Timer(0.002, self.reached, ("mid_batch",)).start()
