"""Ingest benchmark: durable items/s through a real broker, against the disk and Redis Streams.

Run from the repository root (about two minutes; writes up to ~15 GB under
the bench dir and removes it at the end):

    .venv/bin/python bench/ingest.py [--items N] [--repeat K] [--dir PATH]
                                     [--text-lines N] [--profile auto|on|off] [--no-docs]

In one run, on one disk (default dir: var/bench-ingest under the repository):

1. disk: pwrite + fdatasync bandwidth at 8 MiB chunks (one 4096-item chunk
   of 512-token items), K times;
2. Inference Fabric: a broker (`run.py --config`, default process counts,
   256 MiB segments, 4096-item chunks) takes N pre-tokenised 512-token items
   from `Producer.submit_tokens` in this process, K times (a new job each);
   items/s, tokens/s and slot MB/s against the disk, CPU per process, and
   the broker's memory early in the first submit against the end of the
   last. Then SIGTERM (exit code 0 expected) and `run.py check` (clean
   expected). Under `--profile auto` py-spy samples the stages during one
   more submit when the items/s target is missed (bench/ingest_fabric.py);
3. Redis Streams, when redis-server is installed: the same rows XADDed one
   entry each, pipelined 1024 at a time, AOF fsynced every second
   (bench/ingest_redis.py);
4. text: an OpenAI Batch JSONL file of 20-40 word prompts through
   `submit_file`, tokenised in the broker with a word-level tokenizer.json
   built here, with 1 and 2 tokeniser processes (bench/ingest_text.py).

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import disk, ingest_fabric, ingest_redis, ingest_text, machine
from bench.ingest_common import (
    CHUNK_ITEMS,
    SEED,
    SLOT_BYTES,
    TOKENS,
    WINDOW,
    Outcome,
    Plan,
    progress,
)
from bench.report import Row, render_section, write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/ingest.py"
DISK_CHUNK_BYTES = CHUNK_ITEMS * TOKENS * 4  # 8 MiB
DISK_TOTAL_BYTES = 1 << 30
SPARE_BYTES = 2 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="items per submit")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-ingest")
    parser.add_argument("--text-lines", type=int, default=200_000, help="lines of step 4")
    parser.add_argument(
        "--profile",
        choices=("auto", "on", "off"),
        default="auto",
        help="py-spy the stages after step 2 (auto: when the items/s target is missed)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args(argv)
    if args.items < CHUNK_ITEMS or args.repeat < 1 or args.text_lines < 1:
        parser.error(f"need --items >= {CHUNK_ITEMS}, --repeat >= 1, --text-lines >= 1")
    return args


def fit_to_disk(plan: Plan) -> Plan:
    """Scale the item count down, and say so, when the disk cannot hold the run.

    Peak use: step 2's log (K submits and the profiled ones) or step 3's
    AOF files (two series of K runs), whichever is larger.
    """
    free = shutil.disk_usage(plan.root).free
    per_item = max(SLOT_BYTES * (plan.repeat + 2), ingest_redis.BYTES_PER_ITEM * plan.repeat)
    needed = plan.items * per_item + DISK_TOTAL_BYTES + SPARE_BYTES
    if needed <= free:
        return plan
    items = max(CHUNK_ITEMS, int((free - DISK_TOTAL_BYTES - SPARE_BYTES) // per_item))
    note = (
        f"Scaled down: {free / 2**30:.1f} GiB free under {plan.root.parent} but the run needs "
        f"{needed / 2**30:.1f} GiB; items {plan.items:,} -> {items:,}."
    )
    print(f"WARNING: {note}", file=sys.stderr)
    return replace(plan, items=items, notes=(*plan.notes, note))


def bench_disk(plan: Plan) -> Row:
    """Step 1: the disk's durable sequential write bandwidth at the size of one chunk."""
    path = plan.root / "disk.raw"
    values = tuple(
        disk.write_bandwidth(path, DISK_CHUNK_BYTES, DISK_TOTAL_BYTES) / 1e6
        for _ in range(plan.repeat)
    )
    return Row("1 disk", "pwrite+fdatasync, 8 MiB chunks, MB/s", values)


def run(plan: Plan) -> tuple[list[Row], Outcome]:
    outcome = Outcome()
    disk_row = bench_disk(plan)
    progress(f"step 1 (disk) done: {disk_row.median:,.0f} MB/s")
    started = time.perf_counter()
    rows = np.random.default_rng(SEED).integers(1, 30_000, (plan.items, TOKENS), dtype=np.uint32)
    progress(f"built {plan.items:,} items in {time.perf_counter() - started:.1f} s")
    fabric_rows, rates = ingest_fabric.bench_fabric(plan, rows, disk_row.median, outcome)
    progress("step 2 (Inference Fabric) done")
    redis_rows = ingest_redis.bench_redis(plan, rows, rates, outcome)
    progress("step 3 (Redis Streams) done")
    del rows
    text_rows = ingest_text.bench_text(plan, outcome)
    progress("step 4 (text) done")
    return [disk_row, *fabric_rows, *redis_rows, *text_rows], outcome


def method_notes(plan: Plan) -> list[str]:
    return [
        f"Timed: from the first SDK call (`Producer(address, window={WINDOW}).submit_tokens("
        f'job, "echo", rows, chunk_lines={CHUNK_ITEMS})`) until it returns, that is until every '
        "item is durable (appended and fdatasync'd by its writer, the chunk's commit synced "
        "in the job journal) and acknowledged. The producer runs in this process, on the "
        "same cores as the broker.",
        f"Items: {plan.items:,} rows of {TOKENS} uint32 tokens (random ids below 30,000), "
        "built before timing and passed as one 2-D array; each submit is a new job, so the "
        f"log grows to {plan.repeat * plan.items:,} items (nothing consumes them).",
        "Broker: `run.py --config` with 256 MiB segments, 4096-item chunks, one front, "
        "tokenizer, router and writer (the defaults) and one model, `echo`, serving "
        "/v1/embeddings; data dir on the bench dir's disk.",
        "Disk: `bench.disk.write_bandwidth` (pwrite into a posix_fallocate'd file, fdatasync "
        "after each 8 MiB chunk, 1 GiB per repeat, synced pages dropped from the page cache "
        "every 64 MiB), on the same disk.",
        "CPU: user and system time from /proc/<pid>/stat of each process over each submit, "
        "divided by the submit's wall time.",
        "Memory: VmRSS summed over the supervisor and every process under it, sampled every "
        "0.2 s. The shared-memory rings (64 MiB each) count in every process that has touched "
        "them, so the sum overstates the footprint; the growth between two samples does not. "
        "Growth with the backlog is judged between the ends of the first and the last submit "
        "(the same point in a job's life); the growth from 25% of the first submit also "
        "includes the front's state for the job being submitted (its custom_id digests and "
        "their index and prefilter, about 18 B per item, and allocator high water), which it drops when "
        "the job is done.",
        "Text (step 4) is timed the same way with `Producer.submit_file(path, job_id)`: per "
        "tokeniser process, end to end (the producer parses and checks each line, the front "
        "checks the chunk again, a tokeniser encodes it, router and writer store it).",
    ]


def render(
    facts: dict[str, str], rows: list[Row], outcome: Outcome, notes: list[str], seconds: float
) -> str:
    """The section of docs/BENCHMARKS.md, which is also what the command prints."""
    tail = []
    if outcome.profile:
        tail = [
            "",
            "Profile (one more submit after step 2, untimed, under py-spy):",
            "",
            *outcome.profile,
        ]
    return render_section(
        "Ingest (bench/ingest.py)",
        "Durable ingest through a real broker, from the producer SDK to fdatasync'd segments, "
        "against the disk's own bandwidth and against Redis Streams, in one run on one disk.",
        machine.command_line(),
        seconds,
        facts,
        rows,
        notes,
        checks=list(outcome.checks),
        tail=tail,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"ingest-{os.getpid()}"
    root.mkdir()
    plan = fit_to_disk(Plan(root, args.items, args.repeat, args.text_lines, args.profile))
    facts = machine.describe(args.dir)
    started = time.perf_counter()
    try:
        rows, outcome = run(plan)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created and not any(args.dir.iterdir()):
            args.dir.rmdir()
    facts["load average at end"] = machine.load_average()
    notes = [*plan.notes, *method_notes(plan), *outcome.notes]
    body = render(facts, rows, outcome, notes, time.perf_counter() - started)
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
