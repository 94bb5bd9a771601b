"""End-to-end benchmark: submit -> dispatch -> echo workers -> completion -> results client, vs Redis.

Run from the repository root (about four minutes on two cores; writes up to
~6 GB under the bench dir and removes it at the end):

    .venv/bin/python bench/e2e.py [--items N] [--repeat K] [--dir PATH]
                                  [--profile on|off] [--no-docs]

In one run, on one disk (default dir: var/bench-e2e under the repository):

1. Inference Fabric (bench/e2e_fabric.py): per run a fresh broker with
   local echo workers; N pre-tokenised 512-token items submitted with the
   producer SDK while `python run.py results JOB --follow` writes every
   result to a file; timed from the first SDK call until that client exits
   with every result delivered. With [workers] batch_items 1024: one and two
   workers, K times each (the two-worker runs then fetch the finished job
   once more with `--all`: delivery alone); once with every default
   (batch_items 256); once each with `session_max_batches = 64`; once more
   under py-spy. CPU of every process over each run, and every broker
   process's memory at its end;
2. Redis Streams (bench/e2e_redis.py), when redis-server is installed: the
   same items XADDed, two consumers (XREADGROUP, XADD a result, XACK), a
   reader (XREAD the results, write a line each, fdatasync per read), K
   times, each right after step 1's runs of the same repeat; the ratio to
   step 1's two-worker runs, paired by repeat.

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import dispatch_profile, e2e_fabric, e2e_redis, machine
from bench.dispatch_common import ENDPOINT, MAX_TOKENS, make_rows, pressure
from bench.e2e_fabric import Run, Setup
from bench.ingest_common import Outcome, progress
from bench.ingest_redis import redis_binary, redis_version
from bench.report import Row, render_section, write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/e2e.py"
TOKENS = 512
ITEMS_TARGET = 150_000
RATIO_TARGET = 6.0
STEP_FABRIC = "1 fabric"
STEP_REDIS = "2 redis"
PER_ITEM_BYTES = 2080 + 600 + 2300  # input slot, output line and completion slot, Redis AOF
SPARE_BYTES = 4 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-e2e")
    parser.add_argument("--profile", choices=("on", "off"), default="on")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args(argv)
    if args.items < 10_000 or args.repeat < 1:
        parser.error("need --items >= 10,000 and --repeat >= 1")
    return args


def fit_to_disk(root: Path, items: int, notes: list[str]) -> int:
    free = shutil.disk_usage(root).free
    needed = items * PER_ITEM_BYTES + SPARE_BYTES
    if needed <= free:
        return items
    fits = max(10_000, int((free - SPARE_BYTES) // PER_ITEM_BYTES))
    notes.append(
        f"Scaled down: {free / 2**30:.1f} GiB free under {root} but {items:,} items need "
        f"{needed / 2**30:.1f} GiB; ran {fits:,}."
    )
    return fits


HEADLINE = (Setup(1, 1024, 8), Setup(2, 1024, 8))
PAIRED = Setup(2, 1024, 8)  # paired with Redis's two consumers
EXTRA = (Setup(1, 256, 8), Setup(1, 1024, 64), Setup(2, 1024, 64))


def bench_all(root: Path, rows, args, outcome: Outcome):
    """Repeat by repeat: each headline setup, then Redis (so a pair runs close in time); then
    the extra setups once each, and the profiled run. Returns (fabric runs, Redis runs)."""
    n = rows.shape[0]
    binary = redis_binary()
    runs: dict[Setup, list[Run]] = {}
    redis: list[dict] = []
    for r in range(args.repeat):
        for k, setup in enumerate(HEADLINE):
            run = e2e_fabric.run_once(
                root / f"fabric-{k}-{r}", setup, rows, refetch=setup == PAIRED
            )
            runs.setdefault(setup, []).append(run)
            progress(f"step 1: {setup.label}: {run.rate:,.0f} items/s ({run.seconds:.1f} s)")
        if binary is not None:
            redis.append(e2e_redis.run_once(binary, root / f"redis-{r}", rows))
            progress(f"step 2: Redis run {r + 1}: {n / redis[-1]['seconds']:,.0f} items/s")
    for k, setup in enumerate(EXTRA):
        part = rows if setup.batch_items >= 1024 else rows[: max(10_000, n // 4)]
        run = e2e_fabric.run_once(root / f"fabric-extra-{k}", setup, part)
        runs.setdefault(setup, []).append(run)
        progress(f"step 1: {setup.label}: {run.rate:,.0f} items/s ({run.seconds:.1f} s)")
    profiled: list[Run] = []
    if args.profile == "on":
        run = e2e_fabric.run_once(root / "fabric-profile", PAIRED, rows, profile=True)
        profiled.append(run)
        what = (
            f"{PAIRED.label}, {n:,} items, end to end; each process sampled for "
            f"{e2e_fabric.PROFILE_S} s from the start of the run (the results client from its "
            "own start), while submit and delivery overlap"
        )
        outcome.profile += dispatch_profile.render(run.profile, run.rate, what)
    every = [run for done in runs.values() for run in done] + profiled
    codes = [run.exit_code for run in every]
    outcome.checks.append(
        (
            f"every broker ({len(every)} runs) stopped by SIGTERM with exit code 0: {codes}",
            all(code == 0 for code in codes),
        )
    )
    problems = [line for run in every for line in run.log_problems]
    outcome.checks.append(
        (f"stage logs of every run: {len(problems)} warning or error lines", not problems)
    )
    outcome.notes += [f"Stage log: `{line[:300]}`" for line in problems[:5]]
    if binary is None:
        outcome.notes.append("Step 2 skipped: redis-server is not installed.")
    else:
        outcome.notes.append(redis_note(binary, redis))
    return runs, redis


def fabric_rows(runs: dict[Setup, list[Run]]) -> list[Row]:
    out = []
    for setup, done in runs.items():
        headline = setup.batch_items == 1024 and setup.session_max_batches == 8
        n = done[0].items
        out += [
            Row(
                STEP_FABRIC,
                f"{setup.label}, {n:,} items: items/s end to end (submit -> all delivered)",
                tuple(r.rate for r in done),
                target=f">= {ITEMS_TARGET:,}" if headline else "",
                at_least=ITEMS_TARGET if headline else None,
            ),
        ]
        if headline:
            out += [
                Row(
                    STEP_FABRIC,
                    f"{setup.label}: tokens/s end to end (prompt tokens)",
                    tuple(r.rate * TOKENS for r in done),
                ),
                Row(
                    STEP_FABRIC,
                    f"{setup.label}: submit, s (all {n:,} items durable and acknowledged)",
                    tuple(r.submit_s for r in done),
                ),
                Row(
                    STEP_FABRIC,
                    f"{setup.label}: submit returned -> last result delivered, s",
                    tuple(r.seconds - r.submit_s for r in done),
                ),
            ]
        if setup == PAIRED:
            out.append(
                Row(
                    STEP_FABRIC,
                    f"{setup.label}: delivery alone, items/s (`run.py results JOB --all` of the "
                    "finished job: pages, formatting, writes and fsyncs, nothing else running)",
                    tuple(n / r.refetch_s for r in done if r.refetch_s),
                )
            )
    return out


def memory_rows(runs: list[Run], setup: Setup, outcome: Outcome) -> list[Row]:
    """RSS of each broker process at the end of every run of `setup`."""
    labels = sorted({label for r in runs for label in r.rss}, key=_stage_order)

    def parts(m: dict[str, int]) -> str:
        return "/".join(f"{m.get(k, 0) / 2**20:.0f}" for k in ("RssAnon", "RssFile", "RssShmem"))

    last = runs[-1].rss
    outcome.notes.append(
        f"RSS at the end of the last run ({setup.label}), split as RssAnon/RssFile/RssShmem "
        "MiB (RssFile: pages of memory-mapped segment files the process touched, i.e. page "
        "cache; RssShmem: the rings): "
        + ", ".join(f"{label} {parts(last[label])}" for label in labels if label in last)
        + "."
    )
    out = []
    for label in labels:
        values = tuple(r.rss[label].get("VmRSS", 0) / 2**20 for r in runs if label in r.rss)
        out.append(
            Row(STEP_FABRIC, f"{setup.label}: RSS at the end, {label}, MiB", values),
        )
    out.append(
        Row(
            STEP_FABRIC,
            f"{setup.label}: RSS at the end, every broker process summed, MiB",
            tuple(sum(m.get("VmRSS", 0) for m in r.rss.values()) / 2**20 for r in runs),
        )
    )
    return out


def cpu_rows(runs: list[Run], setup: Setup) -> list[Row]:
    """CPU (user + system) of each process over each run, as a share of one core."""
    labels = sorted({label for r in runs for label in r.cpu}, key=_stage_order)
    out = [
        Row(
            STEP_FABRIC,
            f"{setup.label}: CPU of {label}, % of one core",
            tuple(r.cpu.get(label, 0.0) / r.seconds for r in runs),
            percent=True,
        )
        for label in labels
    ]
    cores = len(os.sched_getaffinity(0))
    out.append(
        Row(
            STEP_FABRIC,
            f"{setup.label}: CPU of every process, % of the {cores} cores",
            tuple(sum(r.cpu.values()) / (r.seconds * cores) for r in runs),
            percent=True,
        )
    )
    return out


def _stage_order(label: str) -> tuple[int, str]:
    order = ("supervisor", "producer", "front", "tokenizer", "router", "writer", "dispatch")
    order += ("worker", "completion", "results")
    for k, name in enumerate(order):
        if label.startswith(name):
            return k, label
    return len(order), label


def redis_note(binary: str, done: list[dict]) -> str:
    aof = statistics.median(d["aof"] for d in done) / 2**30 if done else 0.0
    return (
        f"Redis {redis_version(binary)}: `redis-server --appendonly yes --appendfsync everysec "
        '--save "" --auto-aof-rewrite-percentage 0`, a fresh server per run, run right after '
        "the fabric's runs of the same repeat. Producer: this process, XADD `items` with "
        f"fields c (a 13-byte custom_id) and t ({TOKENS * 4} token bytes), 1024 commands per "
        "pipelined round. Consumers: 2 processes, XREADGROUP COUNT 1024 BLOCK 200, then one "
        "pipelined round of an XADD `results` per item (fields i: the item's entry id, c, r: "
        f"its first {MAX_TOKENS} tokens, 64 bytes) and one XACK of the batch. Reader: 1 "
        "process, XREAD COUNT 4096 BLOCK 200 from 0-0, one line per result in the fabric's "
        "output form (orjson), write + fdatasync per read. Consumers and reader are started "
        "and blocked on their first read before the clock starts (the fabric's results "
        "client starts inside its timed run). Redis acknowledges an XADD before its fsync: "
        f"with everysec it may lose up to a second of acknowledged work. AOF at the end of a "
        f"run: {aof:.1f} GiB."
    )


def redis_rows(done: list[dict], n: int, fabric: list[Run]) -> list[Row]:
    if not done:
        return []
    rates = tuple(n / d["seconds"] for d in done)
    return [
        Row(
            STEP_REDIS,
            f"{n:,} items: items/s end to end (first XADD -> reader wrote and synced all)",
            rates,
        ),
        Row(STEP_REDIS, "seconds in XADD (producer)", tuple(d["produce_s"] for d in done)),
        Row(STEP_REDIS, "redis-server RSS at the end, MiB", tuple(d["rss"] / 2**20 for d in done)),
        Row(
            STEP_REDIS,
            f"ratio Inference Fabric ({PAIRED.label}) / Redis items/s, paired by repeat",
            tuple(f.rate / r for f, r in zip(fabric, rates, strict=False)),
            target=f">= {RATIO_TARGET:g}x",
            at_least=RATIO_TARGET,
        ),
    ]


def method_notes(n: int) -> list[str]:
    return [
        f"Workload: {n:,} items of {TOKENS} random token ids (below 30,000) for the `echo` "
        f"model on `{ENDPOINT}` with max_tokens {MAX_TOKENS} (the echo worker returns each "
        "prompt's first 16 tokens), one job, submitted by this process with "
        "`Producer(address, window=8).submit_tokens(..., chunk_lines=4096)`.",
        "Broker: `run.py --config` with 256 MiB segments, default process counts, `[workers] "
        "local = W`, engine echo, batch_items B, batch_tokens B x 512, and `[dispatch] "
        "session_max_batches` as labelled (the default is 64); a fresh broker (and data dir) "
        "per run, stopped with SIGTERM after it.",
        "Timed: from the first SDK call until `python run.py results JOB -o OUT --errors ERR "
        "--follow --config F` exits, having written every result once, fsynced, and had its "
        "last page acknowledged (`ResultsClient.fetch(follow=True)`). The client is started by "
        "the SDK's progress callback when the first chunk is acknowledged, so submit, "
        "dispatch, work, completion and delivery overlap as they would in use. After each "
        "run the output file is counted: one line per item, no error lines.",
        "Memory: VmRSS from /proc/<pid>/status of the supervisor and of each stage (pids "
        "from the supervisor's log), read when the results client has exited, before "
        "SIGTERM. The shared-memory rings (64 MiB each) count in every process that touched "
        "them (front, tokenizer, router, writer).",
        "CPU: two cores for everything (broker stages, workers, producer, results client). "
        "User + system time from /proc/<pid>/stat over the run (the results client's from "
        "its rusage at exit; the producer's is this process's, polling included), over the "
        "run's wall time.",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"e2e-{os.getpid()}"
    root.mkdir()
    facts = machine.describe(args.dir)
    facts["CPU and I/O pressure at start"] = pressure()
    outcome = Outcome()
    notes: list[str] = []
    started = time.perf_counter()
    try:
        n = fit_to_disk(root, args.items, notes)
        rows = make_rows(n, TOKENS)
        runs, redis = bench_all(root, rows, args, outcome)
        two = runs[PAIRED]
        table = fabric_rows(runs) + cpu_rows(two, PAIRED) + memory_rows(two, PAIRED, outcome)
        table += redis_rows(redis, n, two)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created and not any(args.dir.iterdir()):
            args.dir.rmdir()
    facts["load average at end"] = machine.load_average()
    facts["CPU and I/O pressure at end"] = pressure()
    tail = ["", "Profile (step 1, one more run, untimed, under py-spy):", "", *outcome.profile]
    body = render_section(
        "End to end (bench/e2e.py)",
        "Pre-tokenised items from the producer SDK to a results file, through one broker "
        "with local echo workers, against the same workload through Redis Streams.",
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        table,
        [*notes, *method_notes(n), *outcome.notes],
        checks=list(outcome.checks),
        tail=tail if outcome.profile else [],
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
