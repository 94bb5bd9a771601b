"""Step 2 of bench/dispatch.py: do GPU workers ever wait for work? Idle share and dispatch latency.

A broker with default dispatch settings gets a backlog of 512-token items;
then `W` timed workers (bench/dispatch_worker.py: the SDK's `Worker` with
the `simulated` engine at `tokens_per_s` each, default batch size and
prefetch) start together and run for `seconds` after every one of them has
its first batch, while the backlog lasts. Then each gets SIGTERM, drains,
and writes what it measured (see bench/dispatch_worker.py).

Idle share: the SDK's `Worker.idle_s` (time with no batch queued or
running) between a worker's first batch and SIGTERM, over that time;
summed over the fleet for the target. The engine's own gaps (time between
the first batch and SIGTERM not spent in `engine.run`) are reported beside
it. Latency: from a WORK_REQUEST's send to its WORK's handling, in the
worker, pooled over the fleet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.dispatch_common import MAX_TOKENS, MODEL, Status, make_rows, submit, wait_for
from bench.ingest_broker import REPO, BenchBroker
from bench.ingest_common import Outcome, progress
from bench.report import Row
from gpu.worker.options import WorkerOptions

STEP = "2 fed"
TOKENS = 512
IDLE_TARGET = 0.01
BATCH_ITEMS = 256  # the SDK's defaults
PREFETCH = 4
BACKLOG_MARGIN = 1.5  # items submitted: this many times what the fleet can do in the run


@dataclass(frozen=True)
class Fleet:
    workers: int
    tokens_per_s: float  # per worker, as the simulated engine counts them
    seconds: float

    @property
    def items_per_s(self) -> float:
        """Nominal: the simulated engine charges prompt tokens + max_tokens per generate item."""
        return self.workers * self.tokens_per_s / (TOKENS + MAX_TOKENS)

    @property
    def backlog(self) -> int:
        return int(self.items_per_s * self.seconds * BACKLOG_MARGIN) + 100_000


def bench_fed(root: Path, fleet: Fleet, capacity_items_s: float | None, outcome: Outcome):
    broker = BenchBroker(root / "fed", [MODEL])
    stats: list[dict] = []
    try:
        broker.start()
        status = Status(broker)
        try:
            rows = make_rows(fleet.backlog, TOKENS)
            submit(broker, "fed", rows)
            del rows
            wait_for(lambda: status.queued() >= fleet.backlog, "the backlog to be queued", 120)
            progress(
                f"step 2: {fleet.backlog:,} items queued; starting {fleet.workers} simulated "
                f"workers at {fleet.tokens_per_s:,.0f} tokens/s each"
            )
            stats, queued_at_stop, done_in_run = _run_fleet(broker, status, fleet)
        finally:
            status.close()
        code = broker.stop()
        outcome.checks.append(
            (f"step 2 broker stopped by SIGTERM: exit code {code} (expected 0)", code == 0)
        )
        outcome.checks.append(
            (
                f"step 2 backlog lasted the whole run: {queued_at_stop:,} items still queued at "
                "SIGTERM",
                queued_at_stop > 0,
            )
        )
        problems = broker.stage_log_problems()
        outcome.checks.append(
            (f"step 2 stage logs: {len(problems)} warning or error lines", not problems)
        )
        outcome.notes += [f"Stage log: `{line[:300]}`" for line in problems[:5]]
    finally:
        broker.close()
    return _rows(stats, fleet, capacity_items_s, done_in_run, outcome)


def _run_fleet(broker: BenchBroker, status: Status, fleet: Fleet):
    settings = broker.settings
    procs = []
    logs = []
    for k in range(fleet.workers):
        log = open(broker.root / f"fed-worker-{k}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "bench" / "dispatch_worker.py"),
                    *WorkerOptions(
                        broker=settings.dispatch.bind,
                        model=MODEL.name,
                        heartbeat=settings.dispatch.heartbeat_bind,
                        engine="simulated",
                        batch_items=BATCH_ITEMS,
                        prefetch=PREFETCH,
                    ).argv(),
                    "--tokens-per-s",
                    str(fleet.tokens_per_s),
                    "--stats",
                    str(broker.root / f"fed-worker-{k}.json"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
    try:

        def all_fed() -> bool:
            sessions = status.dispatch()["workers"]
            return sum(1 for s in sessions if s["handed_out"] > 0) >= fleet.workers

        wait_for(all_fed, "every worker's first batch", 60, 0.1)
        first = status.finished("fed")
        time.sleep(fleet.seconds)
        done_in_run = status.finished("fed") - first
        queued_at_stop = status.queued()
    finally:
        for proc in procs:
            proc.terminate()
        codes = [proc.wait(timeout=90) for proc in procs]
        for log in logs:
            log.close()
    if any(codes):
        raise RuntimeError(f"step 2: timed workers exited with {codes}; see {broker.root}")
    stats = [
        json.loads((broker.root / f"fed-worker-{k}.json").read_text()) for k in range(len(procs))
    ]
    return stats, queued_at_stop, done_in_run


def _rows(
    stats: list[dict],
    fleet: Fleet,
    capacity_items_s: float | None,
    done_in_run: int,
    outcome: Outcome,
) -> list[Row]:
    windows = [s["stopped"] - s["first_work"] for s in stats]
    idle = [s["idle_window_s"] for s in stats]
    engine_gaps = [w - s["engine_busy_s"] for s, w in zip(stats, windows, strict=True)]
    session = [s["stopped"] - s["opened"] for s in stats]
    work_ms = np.concatenate([np.asarray(s["work_ms"], float) for s in stats])
    no_work = sum(len(s["no_work_ms"]) for s in stats)
    pct = np.percentile(work_ms, [50, 90, 99, 99.9]) if len(work_ms) else [float("nan")] * 4
    measured = done_in_run / fleet.seconds
    rows = [
        Row(
            STEP,
            f"fleet: {fleet.workers} simulated workers x {fleet.tokens_per_s:,.0f} tokens/s, "
            "nominal items/s",
            (fleet.items_per_s,),
        ),
        Row(STEP, "fleet: items/s completed during the run (job counts)", (measured,)),
    ]
    if capacity_items_s:
        rows.append(
            Row(
                STEP,
                "fleet nominal items/s as a share of step 1's 512-token rate (1 echo worker, "
                "batch 1024, max 64 batches/session)",
                (fleet.items_per_s / capacity_items_s,),
                percent=True,
            )
        )
    rows += [
        Row(
            STEP,
            "fleet idle, % of time: sum of Worker.idle_s / sum of time, first batch -> SIGTERM",
            (100 * sum(idle) / sum(windows),),
            target="< 1%",
            below=100 * IDLE_TARGET,
        ),
        Row(
            STEP,
            "per worker idle, % (Worker.idle_s, first batch -> SIGTERM)",
            tuple(100 * i / w for i, w in zip(idle, windows, strict=True)),
        ),
        Row(
            STEP,
            "per worker engine gaps, % (not in engine.run, first batch -> SIGTERM)",
            tuple(100 * g / w for g, w in zip(engine_gaps, windows, strict=True)),
        ),
        Row(
            STEP,
            "per worker Worker.idle_s, % of the whole session (open -> SIGTERM)",
            tuple(100 * s["idle_s"] / t for s, t in zip(stats, session, strict=True)),
        ),
        Row(STEP, "dispatch latency p50, ms (WORK_REQUEST -> WORK)", (pct[0],)),
        Row(STEP, "dispatch latency p90, ms", (pct[1],)),
        Row(STEP, "dispatch latency p99, ms", (pct[2],)),
        Row(STEP, "dispatch latency p99.9, ms", (pct[3],)),
        Row(STEP, "dispatch latency max, ms", (float(work_ms.max()) if len(work_ms) else 0.0,)),
        Row(STEP, "work requests answered with WORK", (float(len(work_ms)),)),
        Row(STEP, "work requests answered with NO_WORK", (float(no_work),)),
    ]
    outcome.notes.append(
        f"Step 2: {fleet.workers} workers, each the SDK's Worker (batch_items {BATCH_ITEMS}, "
        f"prefetch {PREFETCH}) with the simulated engine at {fleet.tokens_per_s:,.0f} tokens/s "
        f"({TOKENS}-token prompts + max_tokens {MAX_TOKENS}: {BATCH_ITEMS} items take "
        f"{BATCH_ITEMS * (TOKENS + MAX_TOKENS) / fleet.tokens_per_s * 1000:.0f} ms); "
        f"{fleet.seconds:g} s after every worker had its first batch, then SIGTERM; "
        f"backlog {fleet.backlog:,} items. Per worker windows (s): "
        + ", ".join(f"{w:.1f}" for w in windows)
        + "."
    )
    return rows
