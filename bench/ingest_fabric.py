"""Step 2 of bench/ingest.py: pre-tokenised items through a real broker, timed from the SDK.

One broker takes K submits of the same N rows (a new job each, so its log
grows to K * N items). Per submit: wall time, and the user and system CPU
of every process (supervisor, stages, this producer) from /proc, and the
writers' fsyncs and items from the broker's metrics
(`fabric_writer_fsync_seconds` count: one fdatasync per touched segment per
step, the group commit; `fabric_writer_items_appended_total`). Over all
submits: the broker's memory, sampled every 0.2 s. Then the broker is
stopped with SIGTERM and checked with `run.py check`; with a profile asked
for (or the items/s target missed, under `--profile auto`), one more
submit runs under py-spy first.
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench import ingest_profile
from bench.ingest_broker import BenchBroker, Model, RssSampler, cpu_times
from bench.ingest_common import CHUNK_ITEMS, SLOT_BYTES, TOKENS, WINDOW, Outcome, Plan, progress
from bench.report import Row
from ingest.submit_client import Producer

ITEMS_TARGET = 300_000
TOKENS_TARGET = 150e6
RSS_GROWTH_TARGET_MIB = 64
PROFILE_S = 8
PROFILED = ("front-0", "router-0", "writer-0")
STEP = "2 fabric"


def bench_fabric(
    plan: Plan, rows: np.ndarray, disk_mb_s: float, outcome: Outcome
) -> tuple[list[Row], tuple[float, ...]]:
    """The rows of step 2, and items/s per submit (for the ratio to Redis)."""
    broker = BenchBroker(plan.root / "fabric", [Model("echo")])
    try:
        broker.start()
        labels = {pid: label for label, pid in broker.pids().items()}
        labels[broker.proc.pid] = "supervisor"
        watched = {label: pid for pid, label in labels.items()} | {"producer (bench)": os.getpid()}
        with RssSampler(broker.proc.pid) as rss, Producer(broker.address, window=WINDOW) as sdk:
            seconds, cpu, marks, syncs = _submits(plan, broker, sdk, rows, watched)
            rates = tuple(rows.shape[0] / s for s in seconds)
            if plan.profile == "on" or (
                plan.profile == "auto" and float(np.median(rates)) < ITEMS_TARGET
            ):
                outcome.profile = _profile(plan, broker, sdk, rows, outcome)
        memory = _memory_rows(rss, marks, labels, plan, outcome)
        _stop_and_check(broker, plan, outcome)
    finally:
        broker.close()
    rate_rows = _rate_rows(rates, seconds, disk_mb_s) + _sync_rows(syncs, seconds)
    return rate_rows + _cpu_rows(cpu, seconds) + memory, rates


def writer_syncs(broker: BenchBroker) -> tuple[float, float]:
    """(fdatasyncs, items appended) by every writer so far, from the broker's metrics."""
    url = f"http://{broker.settings.metrics.bind}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    totals = {"fabric_writer_fsync_seconds_count": 0.0, "fabric_writer_items_appended_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["fabric_writer_fsync_seconds_count"], totals["fabric_writer_items_appended_total"]


def _submits(
    plan: Plan, broker: BenchBroker, sdk: Producer, rows: np.ndarray, watched: dict[str, int]
):
    """Time K submits: seconds and per process (user, system) CPU seconds of each; when
    (monotonic) 25% of the first submit was durable, then when each submit returned; and
    the writers' (fdatasyncs, items) during each."""
    n = rows.shape[0]
    seconds: list[float] = []
    cpu: dict[str, list[tuple[float, float]]] = {label: [] for label in watched}
    marks: list[float] = []
    syncs: list[tuple[float, float]] = []

    def note_quarter(report, lines_done: int) -> None:
        if not marks and report.stored >= n // 4:
            marks.append(time.monotonic())

    for k in range(plan.repeat):
        before = {label: cpu_times(pid) for label, pid in watched.items()}
        synced_before = writer_syncs(broker)
        started = time.perf_counter()
        report = sdk.submit_tokens(
            f"bench-{os.getpid()}-{k}",
            "echo",
            rows,
            chunk_lines=CHUNK_ITEMS,
            progress=note_quarter if k == 0 else None,
        )
        seconds.append(time.perf_counter() - started)
        synced_after = writer_syncs(broker)
        syncs.append((synced_after[0] - synced_before[0], synced_after[1] - synced_before[1]))
        if not marks:  # the first submit took no progress report past 25%
            marks.append(time.monotonic())
        marks.append(time.monotonic())
        for label, pid in watched.items():
            after = cpu_times(pid)
            cpu[label].append((after[0] - before[label][0], after[1] - before[label][1]))
        if report.stored != n or report.rejected:
            raise RuntimeError(
                f"submit {k} stored {report.stored:,} of {n:,} items "
                f"({report.rejected} rejected): {report.errors[:3]}"
            )
        progress(f"step 2: submit {k + 1} of {plan.repeat}: {n / seconds[-1]:,.0f} items/s")
    return seconds, cpu, marks, syncs


def _sync_rows(syncs: list[tuple[float, float]], seconds: list[float]) -> list[Row]:
    """The fsync policy beside the items/s: the writers' fdatasyncs per second (one per
    touched segment per step: the group commit) and the items each made durable."""
    return [
        Row(
            STEP,
            "writer fdatasyncs/s (group commits; each submit)",
            tuple(n / s for (n, _), s in zip(syncs, seconds, strict=True)),
        ),
        Row(
            STEP,
            "items per writer fdatasync",
            tuple(items / max(n, 1) for n, items in syncs),
        ),
    ]


def _rate_rows(rates: tuple[float, ...], seconds: list[float], disk_mb_s: float) -> list[Row]:
    mb_s = tuple(r * SLOT_BYTES / 1e6 for r in rates)
    return [
        Row(
            STEP,
            f"durable ingest, items/s ({TOKENS} tokens each; acknowledged after fdatasync)",
            rates,
            target=f">= {ITEMS_TARGET:,}",
            at_least=ITEMS_TARGET,
        ),
        Row(
            STEP,
            "tokens/s",
            tuple(r * TOKENS for r in rates),
            target=">= 150 M",
            at_least=TOKENS_TARGET,
        ),
        Row(STEP, f"MB/s of slot bytes ({SLOT_BYTES} B per item)", mb_s),
        Row(
            STEP,
            "slot MB/s as a share of the disk's (step 1 median)",
            tuple(m / disk_mb_s for m in mb_s),
            percent=True,
        ),
        Row(STEP, "seconds per submit", tuple(seconds)),
    ]


def _cpu_rows(cpu: dict[str, list[tuple[float, float]]], seconds: list[float]) -> list[Row]:
    out = []
    for label, times in cpu.items():
        if label.startswith("tokenizer"):
            continue  # idle: token ids skip the tokenizers
        out.append(
            Row(
                STEP,
                f"CPU of {label}, % of one core (user + system)",
                tuple((u + s) / t for (u, s), t in zip(times, seconds, strict=True)),
                percent=True,
            )
        )
        if label == "writer-0":
            out.append(
                Row(
                    STEP,
                    "of which system (kernel) time, writer-0",
                    tuple(s / t for (_, s), t in zip(times, seconds, strict=True)),
                    percent=True,
                )
            )
    cores = len(os.sched_getaffinity(0))
    total = [sum(sum(cpu[label][k]) for label in cpu) for k in range(len(seconds))]
    out.append(
        Row(
            STEP,
            f"CPU of every process, % of the {cores} cores",
            tuple(c / (t * cores) for c, t in zip(total, seconds, strict=True)),
            percent=True,
        )
    )
    return out


def _memory_rows(
    rss: RssSampler, marks: list[float], labels: dict[int, str], plan: Plan, outcome: Outcome
) -> list[Row]:
    """Memory early in the first submit and at the end of each one.

    `marks`: when 25% of the first submit was durable, then when each submit
    returned. Growth with the backlog is judged between the ends of the first
    and the last submit (the same point in a job's life); the growth from 25%
    of the first submit also holds one job's working set as it fills.
    """
    quarter, ends = marks[0], marks[1:]
    early = rss.at(quarter)
    at_end = [rss.before(end) for end in ends]

    def mib(sizes: dict[int, int]) -> float:
        return sum(sizes.values()) / 2**20

    def by_process(a: dict[int, int], b: dict[int, int]) -> str:
        growth = {
            labels.get(pid) or _name(pid): (b.get(pid, 0) - a.get(pid, 0)) / 2**20
            for pid in set(a) | set(b)
        }
        ranked = sorted(growth.items(), key=lambda kv: -abs(kv[1]))
        return ", ".join(f"{label} {value:+.1f} MiB" for label, value in ranked)

    outcome.notes.append(
        "Broker RSS growth by process, from 25% of the first submit to the end of the last: "
        f"{by_process(early, at_end[-1])}; from the end of the first submit to the end of the "
        f"last: {by_process(at_end[0], at_end[-1])}."
    )
    k = plan.repeat
    return [
        Row(STEP, "broker RSS after 25% of the first submit, MiB", (mib(early),)),
        Row(
            STEP,
            f"broker RSS at the end of submit {k} ({k * plan.items:,} items in the log), MiB",
            (mib(at_end[-1]),),
        ),
        Row(
            STEP,
            "broker RSS growth, 25% of the first submit -> end of the last, MiB",
            (mib(at_end[-1]) - mib(early),),
        ),
        Row(STEP, "broker RSS at the end of each submit, MiB", tuple(mib(s) for s in at_end)),
        Row(
            STEP,
            f"broker RSS growth, end of submit 1 -> end of submit {k} "
            f"(+{(k - 1) * plan.items:,} items of backlog), MiB",
            (mib(at_end[-1]) - mib(at_end[0]),),
            target=f"< {RSS_GROWTH_TARGET_MIB} MiB (flat)",
            below=RSS_GROWTH_TARGET_MIB,
        ),
        Row(STEP, "broker RSS peak, MiB", (rss.peak(ends[-1]) / 2**20,)),
    ]


def _name(pid: int) -> str:
    """A process that is not a stage (multiprocessing's resource tracker): its command line."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    text = " ".join(w.decode(errors="replace") for w in words)
    return "resource tracker" if "resource_tracker" in text else f"pid {pid}"


def _stop_and_check(broker: BenchBroker, plan: Plan, outcome: Outcome) -> None:
    code = broker.stop()
    outcome.checks.append((f"broker stopped by SIGTERM: exit code {code} (expected 0)", code == 0))
    data_gib = broker.data_bytes() / 2**30
    check_code, check_line = broker.check()
    outcome.checks.append(
        (f"`run.py check` after step 2: exit code {check_code}, `{check_line}`", check_code == 0)
    )
    problems = broker.stage_log_problems()
    outcome.checks.append(
        (f"step 2 stage logs: {len(problems)} warning or error lines", not problems)
    )
    outcome.notes += [f"Stage log: `{line[:300]}`" for line in problems[:5]]
    outcome.notes.append(
        f"Step 2 left {data_gib:.1f} GiB in the data dir ({plan.repeat * plan.items:,} items, "
        "plus those of the profiled submits); removed at the end."
    )


def _profile(
    plan: Plan, broker: BenchBroker, sdk: Producer, rows: np.ndarray, outcome: Outcome
) -> list[str]:
    binary = ingest_profile.py_spy()
    if binary is None:
        outcome.notes.append("Profile skipped: py-spy is not installed.")
        return []
    pids = {label: pid for label, pid in broker.pids().items() if label in PROFILED}
    pids["producer (bench)"] = os.getpid()
    part = rows[: max(CHUNK_ITEMS, rows.shape[0] // 4)]
    done = {"submits": 0, "seconds": 0.0}

    def keep_busy() -> None:
        started = time.perf_counter()
        sdk.submit_tokens(
            f"profile-{os.getpid()}-{done['submits']}", "echo", part, chunk_lines=CHUNK_ITEMS
        )
        done["submits"] += 1
        done["seconds"] += time.perf_counter() - started

    progress(f"step 2: profiling {', '.join(pids)} with py-spy for {PROFILE_S} s")
    profiles = ingest_profile.profile(binary, pids, PROFILE_S, plan.root / "profile", keep_busy)
    rate = done["submits"] * part.shape[0] / max(done["seconds"], 1e-9)
    return ingest_profile.render(profiles, rate)
