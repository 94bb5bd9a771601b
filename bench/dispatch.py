"""Dispatch benchmark: items/s out to workers and back, idle GPUs, latency, memory at 10 M queued.

Run from the repository root (about six minutes on two cores; writes up to
~8 GB under the bench dir and removes it at the end):

    .venv/bin/python bench/dispatch.py [--items N] [--large-items N] [--repeat K]
                                       [--fed-workers W] [--fed-tokens-per-s T] [--fed-seconds S]
                                       [--memory-items N] [--dir PATH] [--steps 123]
                                       [--profile on|off] [--cases all|headline] [--no-docs]

`--cases headline --steps 1 --items 250000 --repeat 3 --profile off --no-docs` is
the short form (about a minute): only the headline case (64-token items, batch
1024, one worker, session_max_batches 64), to compare dispatch's CPU per result
before and after a change.

In one run, each step on a fresh broker (`run.py --config`, free loopback
ports, data dir under the bench dir, default var/bench-dispatch):

1. throughput: a pre-loaded job of N 64-token items (and one of 512-token
   items) handed to `python run.py worker --engine echo` processes, timed
   from the first worker's start until the job's completed count reaches N
   (bench/dispatch_throughput.py), with batch_items 256 and 1024, one and two
   workers, on a broker with `session_max_batches` 8 and one with 64 (the
   default); then one more run under py-spy (dispatch, completion, worker);
2. keeping GPUs fed: W simulated workers at T tokens/s each (well below what
   dispatch delivers) on a deep backlog: the share of time they had no batch
   queued or running, and WORK_REQUEST -> WORK latency (bench/dispatch_fed.py,
   bench/dispatch_worker.py);
3. memory: dispatch-0's VmRSS with 1 M and 10 M items queued, no workers
   (bench/dispatch_memory.py).

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import dispatch_fed, dispatch_memory, dispatch_throughput, machine
from bench.dispatch_common import ENDPOINT, MAX_TOKENS, pressure
from bench.dispatch_throughput import Case
from bench.ingest_common import Outcome, progress
from bench.report import Row, render_section, write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/dispatch.py"
DEFAULT_MAX_BATCHES = 8  # [dispatch] session_max_batches of the first broker (the default is 64)
RAISED_MAX_BATCHES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=2_000_000, help="64-token items per run")
    parser.add_argument("--large-items", type=int, default=1_000_000, help="512-token items")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the headline case")
    parser.add_argument("--fed-workers", type=int, default=8)
    parser.add_argument("--fed-tokens-per-s", type=float, default=1_000_000.0)
    parser.add_argument("--fed-seconds", type=float, default=30.0)
    parser.add_argument("--memory-items", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-dispatch")
    parser.add_argument("--steps", default="123", help="which steps to run, e.g. 13")
    parser.add_argument("--profile", choices=("on", "off"), default="on")
    parser.add_argument(
        "--cases", choices=("all", "headline"), default="all", help="step 1: every case or one"
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args(argv)
    if min(args.items, args.large_items, args.memory_items) < 1_000_000 // 4 or args.repeat < 1:
        parser.error("need --items, --large-items, --memory-items >= 250,000 and --repeat >= 1")
    return args


def throughput_cases(args: argparse.Namespace) -> dict[int, list[Case]]:
    """Per session_max_batches: the cases of step 1. The slow default-limit cases run fewer
    items (their rate is set by the limit, not by the backlog)."""
    small = max(250_000, args.items // 4)
    if args.cases == "headline":
        return {RAISED_MAX_BATCHES: [Case(64, args.items, 1024, 1, args.repeat, headline=True)]}
    return {
        DEFAULT_MAX_BATCHES: [
            Case(64, small, 256, 1),
            Case(64, small, 1024, 1, repeat=args.repeat, headline=True),
            Case(64, small, 1024, 2),
        ],
        RAISED_MAX_BATCHES: [
            Case(64, args.items // 2, 256, 1),
            Case(64, args.items, 1024, 1, repeat=args.repeat, headline=True),
            Case(64, args.items, 1024, 2),
            Case(512, args.large_items, 1024, 1),
        ],
    }


def run(args: argparse.Namespace, root: Path, outcome: Outcome) -> list[Row]:
    rows: list[Row] = []
    capacity = None
    if "1" in args.steps:
        results = []
        for max_batches, cases in throughput_cases(args).items():
            profile = args.profile == "on" and max_batches == RAISED_MAX_BATCHES
            for case, timings in dispatch_throughput.bench_cases(
                root, max_batches, cases, outcome, profile
            ):
                results.append((max_batches, case, timings))
                if case.tokens == 512:
                    capacity = sum(t.rate for t in timings) / len(timings)
        rows += dispatch_throughput.rows_for(results)
        outcome.notes += dispatch_throughput.cap_notes(results)
        progress("step 1 (throughput) done")
    if "2" in args.steps:
        fleet = dispatch_fed.Fleet(args.fed_workers, args.fed_tokens_per_s, args.fed_seconds)
        rows += dispatch_fed.bench_fed(root, fleet, capacity, outcome)
        progress("step 2 (keeping workers fed) done")
    if "3" in args.steps:
        backlog = dispatch_memory.fit_to_disk(root, args.memory_items, 1_000_000)
        rows += dispatch_memory.bench_memory(root, backlog, outcome)
        progress("step 3 (memory) done")
    return rows


def method_notes(args: argparse.Namespace) -> list[str]:
    return [
        f"Workload: pre-tokenised items (random ids below 30,000) for the `echo` model on "
        f"`{ENDPOINT}` with max_tokens {MAX_TOKENS}, submitted with `Producer.submit_tokens` "
        "(4096-item chunks) before any worker starts; a broker per step, with 256 MiB segments "
        "and default process counts, `[workers] local = 0`.",
        "Step 1: each run is a new job on the same broker; its items are queued (dispatch's "
        "status shows them all) before the first `python run.py worker --engine echo "
        "--batch-items B --batch-tokens max(262144, B x lane)` process starts. Status is polled "
        "every 50 ms in this process with the clients `run.py status --json` uses (dispatch: "
        "handed_out, in_flight; completion: the job's completed + failed), so the end is seen "
        "within 50 ms. 'Retired' is the job's completed count at the completion stage: results "
        "durable in the completion log (their input tombstones follow within a flush). Default-"
        "limit cases (8 batches per session) run a quarter of the items. The headline case "
        f"repeats {args.repeat} times.",
        "Step 2 and 3: see the notes below.",
        "CPU: two cores for everything (broker stages, workers, this process).",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"dispatch-{os.getpid()}"
    root.mkdir()
    facts = machine.describe(args.dir)
    facts["CPU and I/O pressure at start"] = pressure()
    outcome = Outcome()
    started = time.perf_counter()
    try:
        rows = run(args, root, outcome)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created and not any(args.dir.iterdir()):
            args.dir.rmdir()
    facts["load average at end"] = machine.load_average()
    facts["CPU and I/O pressure at end"] = pressure()
    tail = []
    if outcome.profile:
        tail = ["", "Profile (step 1, one more run, untimed, under py-spy):", "", *outcome.profile]
    body = render_section(
        "Dispatch (bench/dispatch.py)",
        "How fast dispatch hands a pre-loaded backlog to workers and takes it back retired, "
        "whether a fleet of simulated GPUs ever waits for work, and the dispatch stage's "
        "memory with 10 M items queued.",
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        rows,
        [*method_notes(args), *outcome.notes],
        checks=list(outcome.checks),
        tail=tail,
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
