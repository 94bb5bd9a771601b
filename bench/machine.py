"""What a benchmark ran on: CPU, cores, memory, the filesystem under its directory, versions."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def _mount_of(path: Path) -> tuple[str, str, str, str]:
    """(device, mount point, filesystem type, options) of the mount holding `path`."""
    target = str(path.resolve())
    best = ("unknown", "/", "unknown", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        device, mount, fstype, options = line.split()[:4]
        mount = mount.replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[1]):
            best = (device, mount, fstype, options)
    return best


def _rotational(device: str) -> str:
    flag = Path("/sys/class/block") / Path(device).name / "queue" / "rotational"
    try:
        return (
            "kernel says rotational"
            if flag.read_text().strip() == "1"
            else "kernel says non-rotational"
        )
    except OSError:
        return "rotational: unknown"


def command_line() -> str:
    """The command exactly as it was typed (interpreter included)."""
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def describe(directory: Path) -> dict[str, str]:
    """One line per fact about the machine and the disk under `directory`."""
    device, mount, fstype, options = _mount_of(directory)
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": f"{cores} ({usable} usable by this process)",
        "ram": f"{_ram_gib():.1f} GiB",
        "disk": f"{fstype} on {device} ({_rotational(device)}), mounted at {mount} ({options})",
        "bench dir": str(directory.resolve()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load average at start": load_average(),
    }


def load_average() -> str:
    """1, 5 and 15 minute load averages: other work sharing the machine skews timings."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"
