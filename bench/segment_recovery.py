"""Step 4 of bench/segment.py: recovery of the backlog, its time and its peak memory."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import disk
from bench.report import Row
from bench.segment_backlog import build_backlog, retire_half, unseal
from pipeline.store.datadir import DataDir
from pipeline.store.recovery import recover

PROBE = Path(__file__).resolve().parent / "recovery_probe.py"
TARGET_ITEMS = 5_000_000
TARGET_S = 1.0
MEMORY_ITEMS = 1_000_000
TARGET_GROWTH_MIB = 16
STEP = "4 recovery"


def timed_recover(data_dir: DataDir) -> tuple[float, int]:
    """One recover() under the data dir's lock; (wall seconds, LIVE items found)."""
    data_dir.lock()
    try:
        started = time.perf_counter()
        report = recover(data_dir)
        return time.perf_counter() - started, report.live
    finally:
        data_dir.unlock()


def bench_recovery(data_dir: DataDir, items: int, repeat: int) -> tuple[list[Row], str]:
    """Warm, then cold page cache, each run from unsealed headers; rows, and how it evicted."""
    warm, cold, how = [], [], ""
    for _ in range(repeat):
        unseal(data_dir)
        warm.append(timed_recover(data_dir))
    for _ in range(repeat):
        unseal(data_dir)
        how = disk.evict(data_dir.segment_files())
        cold.append(timed_recover(data_dir))
    live = {found for _, found in warm + cold}
    if len(live) != 1:
        raise RuntimeError(f"recovery found different LIVE counts across runs: {sorted(live)}")
    rows = [
        _time_row(f"seconds, {name} page cache", runs, items)
        for name, runs in (("warm", warm), ("cold", cold))
    ]
    rows.append(Row(STEP, "items/s, cold", tuple(items / s for s, _ in cold)))
    return rows, how


def _time_row(measure: str, runs: list[tuple[float, int]], items: int) -> Row:
    scaled = "" if items == TARGET_ITEMS else " (scaled)"
    return Row(
        STEP,
        f"{measure} ({items:,} items, {runs[0][1]:,} LIVE)",
        tuple(s for s, _ in runs),
        target=f"< {TARGET_S:.0f} s for {TARGET_ITEMS / 1e6:.0f} M items{scaled}",
        below=TARGET_S,
        per_target=TARGET_ITEMS / items,
    )


def peak_mib(data_dir: DataDir) -> tuple[float, float]:
    """(recovery process, largest scan worker) peak RSS in MiB, from a fresh interpreter."""
    unseal(data_dir)
    # Linux carries ru_maxrss across execve, so a probe exec'd from this large
    # process would report this process's peak; a shell that forks it does not.
    command = shlex.join([sys.executable, str(PROBE), str(data_dir.root)]) + "; exit $?"
    done = subprocess.run(["/bin/sh", "-c", command], check=True, capture_output=True, text=True)
    found = json.loads(done.stdout)
    return found["self_kib"] / 1024, found["children_kib"] / 1024


def bench_memory(root: Path, big: DataDir, items: int, rng: np.random.Generator) -> list[Row]:
    """Peak RSS of recovery for an empty data dir, a 1M-item backlog and the big backlog."""
    small = DataDir(root / "backlog-small")
    small_items = min(MEMORY_ITEMS, items)
    build_backlog(small.root, small_items, rng)
    retire_half(small, rng)
    empty = DataDir(root / "backlog-empty").ensure()
    rows = [Row(STEP, "peak RSS, empty data dir (no pool), MiB", (peak_mib(empty)[0],))]
    peaks = []
    for data_dir, n in ((small, small_items), (big, items)):
        peaks.append(peak_mib(data_dir))
        for who, mib in zip(("recovery process", "largest scan worker"), peaks[-1], strict=True):
            rows.append(Row(STEP, f"peak RSS, {who}, {n:,} items, MiB", (mib,)))
    growth = max(b - s for b, s in zip(peaks[1], peaks[0], strict=True))
    rows.append(
        Row(
            STEP,
            f"peak RSS growth {small_items:,} -> {items:,} items, MiB",
            (growth,),
            target=f"< {TARGET_GROWTH_MIB} MiB (flat)",
            below=TARGET_GROWTH_MIB,
        )
    )
    return rows


def notes(evicted: str) -> list[str]:
    return [
        "Recovery: before every run the sealed word of every header is cleared, as after a "
        "crash, so each run takes the full repair path (scan markers, check the tail, "
        "recount, rewrite and fdatasync every header). Counts are already right, so this "
        "restores exactly the state before the previous run.",
        f"Cold cache: {evicted}. The disk is virtual here, so the host may still cache what "
        f"the guest dropped.",
        "Peak memory: one fresh interpreter per backlog (forked by a shell, since Linux "
        "carries ru_maxrss across execve), ru_maxrss of the process (RUSAGE_SELF) and of its "
        "largest fork worker (RUSAGE_CHILDREN, which includes pages shared with the parent); "
        "the empty data dir is the interpreter and numpy alone (no pool for fewer than two "
        "segments).",
    ]
