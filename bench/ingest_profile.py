"""Where each broker stage spends its time: py-spy on every stage while items stream through.

`profile(pids, seconds, out_dir, keep_busy)` runs one `py-spy record -f raw`
per process (front, router, writer, and the producer: this process), all at
once, and calls `keep_busy()` (a submit) until every py-spy has finished.
py-spy leaves out most samples where a thread is blocked, so the samples
of a process over `seconds * RATE` is about the share of wall time it was
at work (on the CPU, or in a disk call such as fdatasync); `Profile.top()` gives
the lines where those samples were (self time: the innermost frame; time
in a library is shown as the call a project line made into it), and
`by_function()` the time under each function of the project (inclusive).
Samples parked in zmq polls and thread waits, which py-spy counts as
active, are counted as waiting.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RATE = 200  # samples per second


def py_spy() -> str | None:
    """py-spy next to this interpreter (the venv), or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


WAITS = ("Poller.poll", "Socket.poll", "Condition.wait", "GarbageCollectorThread.run")
PROJECT = ("ingest/", "router/", "pipeline/", "config/", "gpu/", "collector/")


@dataclass(frozen=True)
class Profile:
    label: str
    seconds: float
    stacks: Counter  # tuple of frames, outermost first -> samples

    def _working(self) -> dict[tuple[str, ...], int]:
        """Stacks not parked in a wait (zmq poll, threading wait), which py-spy counts as active."""
        return {s: n for s, n in self.stacks.items() if not s[-1].startswith(WAITS)}

    @property
    def wall_samples(self) -> float:
        return self.seconds * RATE

    @property
    def busy(self) -> float:
        """Share of wall time with a thread at work (on the CPU or in a disk call)."""
        return sum(self._working().values()) / self.wall_samples

    @property
    def waiting(self) -> float:
        return (sum(self.stacks.values()) - sum(self._working().values())) / self.wall_samples

    def top(self, n: int) -> list[tuple[float, str]]:
        """The n innermost lines with the most samples, as shares of wall time.

        Time in a library is shown as the library call a project line made.
        """
        leaves: Counter = Counter()
        for stack, count in self._working().items():
            leaves[_attributed(stack)] += count
        return [(count / self.wall_samples, line) for line, count in leaves.most_common(n)]

    def by_function(self, n: int) -> list[tuple[float, str]]:
        """Share of wall time under each project function, the outer loop left out."""
        working = self._working()
        total = max(1, sum(working.values()))
        under: Counter = Counter()
        for stack, count in working.items():
            for name in {_function(f) for f in stack if _in_project(f)}:
                under[name] += count
        inner = [(c, name) for name, c in under.most_common() if c < 0.95 * total]
        return [(c / self.wall_samples, name) for c, name in inner[:n]]


def _attributed(stack: tuple[str, ...]) -> str:
    """The innermost project line, or the library call it made (np.searchsorted, not _wrapfunc)."""
    if _in_project(stack[-1]):
        return _short(stack[-1])
    for i in range(len(stack) - 2, -1, -1):
        if _in_project(stack[i]):
            return f"{_short(stack[i + 1])} <- {_short(stack[i])}"
    return _short(stack[-1])


def _function(frame: str) -> str:
    """'step (router/router_stage.py:123)' -> 'router/router_stage.py:step'."""
    name, _, where = frame.partition(" (")
    return f"{where.rsplit(':', 1)[0]}:{name}"


def _in_project(frame: str) -> bool:
    return frame.partition(" (")[2].startswith(PROJECT)


def read_raw(path: Path, label: str, seconds: float) -> Profile:
    stacks: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return Profile(label, seconds, stacks)


def profile(
    binary: str,
    pids: dict[str, int],
    seconds: float,
    out_dir: Path,
    keep_busy: Callable[[], None],
) -> list[Profile]:
    """Sample every process in `pids` for `seconds` while `keep_busy()` is called in a loop."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = [binary, "record", "-d", f"{seconds:g}", "-r", str(RATE), "-f", "raw"]
    spies = {
        label: subprocess.Popen(
            [*record, "-o", str(out_dir / f"{label}.txt"), "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for label, pid in pids.items()
    }
    time.sleep(0.5)  # let every py-spy attach before the work starts
    while any(spy.poll() is None for spy in spies.values()):
        keep_busy()
    profiles = []
    for label, spy in spies.items():
        path = out_dir / f"{label}.txt"
        if spy.returncode == 0 and path.exists():
            profiles.append(read_raw(path, label, seconds))
    return profiles


def render(profiles: list[Profile], items_per_s: float, n: int = 8) -> list[str]:
    """Markdown: per process, how busy it was, its top lines and its project functions."""
    lines = [
        f"Throughput while profiled: {items_per_s:,.0f} items/s (py-spy stops each process "
        f"{RATE} times a second to sample it, so this is lower than in the timed runs). Shares "
        "are of wall time; samples in zmq polls and thread waits count as waiting.",
        "",
    ]
    for p in profiles:
        lines += [
            f"**{p.label}**: working {100 * p.busy:.0f}% of the time, waiting in polls "
            f"{100 * p.waiting:.0f}%, idle (blocked, not sampled) the rest.",
            "",
            "| wall time | line (time in a library: the call, <- the project line making it) |",
            "|---|---|",
            *[f"| {100 * share:.1f}% | `{line}` |" for share, line in p.top(n)],
            "",
            "| wall time | under project function |",
            "|---|---|",
            *[f"| {100 * share:.1f}% | `{name}` |" for share, name in p.by_function(n)],
            "",
        ]
    return lines


def _short(frame: str) -> str:
    """Trim site-packages and stdlib paths to the package."""
    name, _, where = frame.partition(" (")
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    elif "/lib/python" in where:
        where = "stdlib/" + where.split("/lib/python", 1)[1].split("/", 1)[1]
    return f"{name} ({where}"
