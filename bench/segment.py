"""Segment log benchmark: durable append, tombstoning and recovery against the disk's limit.

Run from the repository root (a few minutes; writes several GB under the
bench dir and removes them at the end):

    .venv/bin/python bench/segment.py [--dir PATH] [--items N]
                                      [--recovery-items N] [--repeat K] [--no-docs]

In one run, on one disk (default dir: var/bench under the repository), it
measures, K times each:

1. disk bandwidth, the physical limit: pwrite into a posix_fallocate'd file
   with an fdatasync after every chunk, at the append batch size and at 16 MiB;
2. durable append: 512-token items (uint32) through SegmentAppender (256 MiB
   segments), 1024 items per batch, one sync() per batch (group commit),
   interleaved with step 1 so that each repeat gives a paired ratio;
3. tombstoning: random LIVE slots of a backlog retired in completion batches
   of 100k, grouped by segment (one Segment.tombstone call per segment a
   batch touches), without sync, with a sync every 100 ms, and every batch;
4. recovery of that backlog (64-token items, half retired, every segment
   unsealed as after a crash) with a warm and a cold page cache, and its peak
   memory in a fresh process for two backlog sizes.

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
The steps live in bench/segment_append.py, segment_backlog.py and
segment_recovery.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import machine, segment_append, segment_backlog, segment_recovery
from bench.report import Row, render_section, write_section
from bench.segment_items import SEGMENT_BYTES
from pipeline.store.datadir import DataDir

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/segment.py"
SPARE_BYTES = 2 << 30  # left free on the disk, beyond what the run needs
SEED = 20240601


@dataclass(frozen=True)
class Plan:
    root: Path  # this run's directory, removed at the end
    items: int  # appended per repeat in step 2
    recovery_items: int  # the backlog of steps 3 and 4
    repeat: int
    notes: tuple[str, ...] = ()

    @property
    def batches(self) -> int:
        return self.items // segment_append.BATCH_ITEMS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench")
    parser.add_argument("--items", type=int, default=1 << 20, help="items appended per repeat")
    parser.add_argument("--recovery-items", type=int, default=segment_recovery.TARGET_ITEMS)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args(argv)
    batch = segment_append.BATCH_ITEMS
    if args.items < batch or args.recovery_items < 2 or args.repeat < 1:
        parser.error(f"need --items >= {batch}, --recovery-items >= 2, --repeat >= 1")
    return args


def needed_bytes(items: int, recovery_items: int) -> int:
    """Disk space the run needs at its peak (steps run one after the other)."""
    append = 2 * items * segment_append.SLOT_BYTES + 2 * SEGMENT_BYTES  # log + raw file
    slot = segment_backlog.SLOT_BYTES + 4
    backlog = (recovery_items + min(segment_recovery.MEMORY_ITEMS, recovery_items)) * slot
    return max(append, backlog + 4 * SEGMENT_BYTES) + SPARE_BYTES


def fit_to_disk(plan: Plan) -> Plan:
    """Scale the item counts down, and say so, when the disk cannot hold the run."""
    free = shutil.disk_usage(plan.root).free
    needed = needed_bytes(plan.items, plan.recovery_items)
    if needed <= free:
        return plan
    scale = max(0.01, (free - SPARE_BYTES) / (needed - SPARE_BYTES))
    batch = segment_append.BATCH_ITEMS
    items = max(batch, int(plan.items * scale) // batch * batch)
    recovery_items = max(2, int(plan.recovery_items * scale))
    note = (
        f"Scaled down: {free / 2**30:.1f} GiB free under {plan.root.parent} but the run "
        f"needs {needed / 2**30:.1f} GiB; items {plan.items:,} -> {items:,}, recovery items "
        f"{plan.recovery_items:,} -> {recovery_items:,}."
    )
    print(f"WARNING: {note}", file=sys.stderr)
    return replace(plan, items=items, recovery_items=recovery_items, notes=(*plan.notes, note))


def run(plan: Plan) -> tuple[list[Row], list[str]]:
    """Every step in order; the rows, and what a reader needs to know about the method."""
    rng = np.random.default_rng(SEED)
    rows = segment_append.bench_append(plan.root, plan.batches, plan.repeat, rng)
    _progress("steps 1-2 (disk, append) done")
    big = DataDir(plan.root / "backlog")
    build_s = segment_backlog.build_backlog(big.root, plan.recovery_items, rng)
    rows.append(
        Row(
            "backlog",
            f"build: items/s (64-token items, {segment_backlog.BUILD_BATCH_ITEMS:,} per sync)",
            (plan.recovery_items / build_s,),
        )
    )
    rows += segment_backlog.bench_tombstone(big, plan.repeat, rng)
    _progress("step 3 (tombstone) done")
    recovery_rows, evicted = segment_recovery.bench_recovery(big, plan.recovery_items, plan.repeat)
    rows += recovery_rows
    rows += segment_recovery.bench_memory(plan.root, big, plan.recovery_items, rng)
    _progress("step 4 (recovery) done")
    notes = [
        *segment_append.notes(plan.batches),
        *segment_backlog.notes(plan.recovery_items, len(big.segment_files())),
        *segment_recovery.notes(evicted),
    ]
    return rows, notes


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def render(facts: dict[str, str], rows: list[Row], notes: list[str], seconds: float) -> str:
    """The section of docs/BENCHMARKS.md, which is also what the command prints."""
    return render_section(
        "Segment log (bench/segment.py)",
        "Durable append, tombstoning and recovery of the segment log, measured against the "
        "disk's own durable write bandwidth, in one run on one disk.",
        machine.command_line(),
        seconds,
        facts,
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"segment-{os.getpid()}"
    root.mkdir()
    items = args.items // segment_append.BATCH_ITEMS * segment_append.BATCH_ITEMS
    plan = fit_to_disk(Plan(root, items, args.recovery_items, args.repeat))
    facts = machine.describe(args.dir)
    started = time.perf_counter()
    try:
        rows, notes = run(plan)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created and not any(args.dir.iterdir()):
            args.dir.rmdir()
    facts["load average at end"] = machine.load_average()
    body = render(facts, rows, [*plan.notes, *notes], time.perf_counter() - started)
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        _progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
