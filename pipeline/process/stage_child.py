"""One stage process as the supervisor keeps it (pipeline/process/supervisor.py): `StageChild`, with
its process, deaths and restart time, and what its entry in the supervisor's report says
(pipeline/process/supervisor_report.py); `describe_exit` words a process's end for people."""

from __future__ import annotations

import multiprocessing.process
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pipeline.process.stage import StageSpec


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a multiprocessing exitcode."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass
class StageChild:
    spec: StageSpec
    process: multiprocessing.process.BaseProcess | None = None
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    ready: Any = None  # a multiprocessing Event the stage sets once it is up; None once seen
    started_at: float = 0.0
    in_a_row: int = 0  # deaths since it last ran restart_window_s without dying
    total_deaths: int = 0
    last_exit: str = ""
    last_error: str | None = None
    log_offset: int = 0  # where its log ended when it last started
    starts: int = 0
    up: bool = False  # its process set its ready event

    def release_ready(self) -> None:
        """Drop its ready event, once the event is seen set or its process ended: nothing waits
        on it any more. The event's five named semaphores (in /dev/shm) are unlinked when the
        last reference to it goes; a broker that served leaves by `os._exit` (run.py), where
        no finalizer runs, so an event still held then is left for the resource tracker,
        which warns of "leaked semaphore objects" and unlinks them itself."""
        self.ready = None

    def state(self, running: bool) -> str:
        """up, starting, restarting (while the broker runs) or stopped."""
        if self.process is not None:
            return "up" if self.up else "starting"
        return "restarting" if self.restart_at is not None and running else "stopped"

    def report_entry(self, now: float, now_ns: int, running: bool) -> dict:
        """Its entry in the supervisor's report, at monotonic `now` (wall clock `now_ns`)."""
        waiting = self.process is None and self.restart_at is not None
        return {
            "stage": self.spec.label,
            "pid": self.process.pid if self.process is not None else 0,
            "state": self.state(running),
            "critical": self.spec.critical,
            "restarts": max(0, self.starts - 1),
            "deaths": self.total_deaths,
            "deaths_in_a_row": self.in_a_row,
            "last_exit": self.last_exit,
            "last_error": self.last_error,
            "restart_at_ns": now_ns + int(max(0.0, self.restart_at - now) * 1e9) if waiting else 0,
        }
