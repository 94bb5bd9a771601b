"""Step 1 of bench/dispatch.py: how fast a pre-loaded backlog goes out to echo workers and back.

Per case: a job of N items is submitted to a broker with no workers and
left until dispatch knows every item (`status`: N queued); then K
`python run.py worker --engine echo` processes start, and status is polled
every 50 ms (dispatch's counters, and the job's counts at the completion
stage) until the job's completed count reaches N. Timed from the moment
the first worker process is started, so worker start-up (an interpreter,
imports, registration) is inside the time and is also reported on its own.

Cases run on two brokers: one with `[dispatch] session_max_batches = 8`
and one with 64 (the default). A batch counts against that budget until its
results pass through dispatch (not until its retire, ~100 ms later), so
both keep a worker busy; the two show how much the budget still matters.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import dispatch_profile, ingest_profile
from bench.dispatch_common import MODEL, Status, Workers, make_rows, submit, wait_for
from bench.ingest_broker import BenchBroker, cpu_times
from bench.ingest_common import Outcome, progress
from bench.report import Row

STEP = "1 throughput"
ITEMS_TARGET = 200_000
POLL_S = 0.05
RUN_TIMEOUT_S = 300.0
PROFILE_S = 6
PROFILED = ("dispatch-0", "completion-0")
CPU_OF = ("dispatch-0", "completion-0")


@dataclass(frozen=True)
class Case:
    tokens: int
    items: int
    batch_items: int
    workers: int
    repeat: int = 1
    headline: bool = False  # the case the target is judged on

    @property
    def batch_tokens(self) -> int:
        return max(262_144, self.batch_items * self.tokens)

    @property
    def label(self) -> str:
        k = "worker" if self.workers == 1 else "workers"
        return f"{self.tokens} tok, batch {self.batch_items}, {self.workers} {k}"


@dataclass
class Timing:
    items: int
    seconds: float  # first worker started -> completed count == N
    first_out_s: float  # first worker started -> dispatch's first hand-out
    handed_s: float  # first worker started -> every item handed out
    submit_s: float
    peak_in_flight: int
    cpu: dict[str, float]  # process -> CPU seconds (user + system) from worker start to done

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def steady_rate(self) -> float:
        """Items/s from the first hand-out (worker start-up left out)."""
        return self.items / (self.seconds - self.first_out_s)


def run_case(
    broker: BenchBroker,
    status: Status,
    case: Case,
    rows: np.ndarray,
    job: str,
    on_started=None,
) -> Timing:
    """Submit, wait until queued, start workers, poll until done, stop workers."""
    n = rows.shape[0]
    submit_s = submit(broker, job, rows)
    wait_for(lambda: status.queued() >= n, f"dispatch to queue {n:,} items", 120)
    before = status.dispatch()
    out0 = int(before["handed_out"])
    workers = Workers(
        broker, case.workers, batch_items=case.batch_items, batch_tokens=case.batch_tokens
    )
    stages = {label: pid for label, pid in broker.pids().items() if label in CPU_OF}
    cpu0 = {label: sum(cpu_times(pid)) for label, pid in stages.items()}
    started = time.monotonic()
    workers.start()
    first_out = handed = None
    peak = 0
    try:
        if on_started is not None:
            on_started(workers, status, job)
        while True:
            info = status.dispatch()
            now = time.monotonic()
            out = int(info["handed_out"]) - out0
            peak = max(peak, int(info["in_flight"]))
            if first_out is None and out > 0:
                first_out = now
            if handed is None and out >= n:
                handed = now
            if status.finished(job) >= n:
                break
            if now - started > RUN_TIMEOUT_S:
                raise RuntimeError(f"{case.label}: not done in {RUN_TIMEOUT_S:g} s: {info}")
            time.sleep(POLL_S)
        done = time.monotonic()
        cpu = {label: sum(cpu_times(pid)) - cpu0[label] for label, pid in stages.items()}
        for k, pid in enumerate(workers.pids):
            cpu[f"worker {k}"] = sum(cpu_times(pid))  # since its start
    finally:
        codes = workers.stop()
    if any(codes):
        raise RuntimeError(f"{case.label}: workers exited with {codes}")
    return Timing(
        n,
        done - started,
        (first_out or done) - started,
        (handed or done) - started,
        submit_s,
        peak,
        cpu,
    )


def bench_cases(
    root: Path, max_batches: int, cases: list[Case], outcome: Outcome, profile: bool = False
) -> list[tuple[Case, list[Timing]]]:
    """Every case on one broker with `session_max_batches = max_batches`."""
    broker = BenchBroker(
        root / f"throughput-{max_batches}",
        [MODEL],
        sections={"dispatch": {"session_max_batches": max_batches}},
    )
    results = []
    try:
        broker.start()
        status = Status(broker)
        try:
            rows_by_shape: dict[tuple[int, int], np.ndarray] = {}
            for c, case in enumerate(cases):
                key = (case.items, case.tokens)
                if key not in rows_by_shape:
                    rows_by_shape = {key: make_rows(case.items, case.tokens)}
                timings = []
                for r in range(case.repeat):
                    job = f"throughput-{max_batches}-{c}-{r}"
                    timings.append(run_case(broker, status, case, rows_by_shape[key], job))
                    progress(
                        f"step 1: session_max_batches {max_batches}, {case.label}: "
                        f"{timings[-1].rate:,.0f} items/s ({timings[-1].seconds:.1f} s)"
                    )
                results.append((case, timings))
            if profile:
                outcome.profile += _profile(broker, status, cases, rows_by_shape, max_batches)
        finally:
            status.close()
        code = broker.stop()
        outcome.checks.append(
            (
                f"step 1 broker (session_max_batches {max_batches}) stopped by SIGTERM: exit code "
                f"{code} (expected 0)",
                code == 0,
            )
        )
        problems = broker.stage_log_problems()
        outcome.checks.append(
            (
                f"step 1 broker (session_max_batches {max_batches}) stage logs: "
                f"{len(problems)} warning or error lines",
                not problems,
            )
        )
        outcome.notes += [f"Stage log: `{line[:300]}`" for line in problems[:5]]
    finally:
        broker.close()
    return results


def _profile(broker, status, cases, rows_by_shape, max_batches) -> list[str]:
    """One more run of the headline case with py-spy on dispatch, completion and the worker."""
    binary = ingest_profile.py_spy()
    if binary is None:
        return ["Profile skipped: py-spy is not installed."]
    case = next((c for c in cases if c.headline), cases[-1])
    case = Case(case.tokens, case.items, case.batch_items, 1)
    rows = rows_by_shape.get((case.items, case.tokens))
    if rows is None:
        rows = make_rows(case.items, case.tokens)
    found: dict = {}

    def on_started(workers: Workers, status: Status, job: str) -> None:
        wait_for(lambda: status.dispatch()["handed_out"] > 0, "the first hand-out", 60)
        pids = {label: pid for label, pid in broker.pids().items() if label in PROFILED}
        pids["worker (run.py worker)"] = workers.pids[0]
        first = status.finished(job)
        began = time.monotonic()
        progress(f"step 1: profiling {', '.join(pids)} with py-spy for {PROFILE_S} s")
        found["profiles"] = ingest_profile.profile(
            binary, pids, PROFILE_S, broker.root / "profile", lambda: time.sleep(0.1)
        )
        found["rate"] = (status.finished(job) - first) / (time.monotonic() - began)

    timing = run_case(broker, status, case, rows, f"profile-{max_batches}", on_started)
    lines = [
        f"Profiled run: {case.label}, {case.items:,} items, session_max_batches {max_batches}; "
        f"{timing.rate:,.0f} items/s over the whole run.",
        "",
    ]
    what = f"job completions over the {PROFILE_S} s sampled"
    return lines + dispatch_profile.render(found.get("profiles", []), found.get("rate", 0.0), what)


def cap_notes(results: list[tuple[int, Case, list[Timing]]]) -> list[str]:
    """Where the peak in flight reached the lease budget (session_max_batches x batch_items per
    worker): a session's batches stay leased until their tombstones are flushed and dispatch
    is told, so that budget over the lease's round trip bounds the rate."""
    notes = []
    for max_batches, case, timings in results:
        if not (case.headline or case.repeat > 1):
            continue
        budget = max_batches * case.batch_items * case.workers
        peak = max(t.peak_in_flight for t in timings)
        round_trip_ms = 1000 * budget / statistics.median(t.steady_rate for t in timings)
        notes.append(
            f"Step 1, {case.label}, max {max_batches} batches/session: peak in flight "
            f"{peak:,} of a lease budget of {budget:,} items ({max_batches} x "
            f"{case.batch_items} x {case.workers}); at the budget, the steady rate means each "
            f"lease lasted about {round_trip_ms:.0f} ms from hand-out to dispatch hearing it "
            "retired (tombstones are flushed every tombstone_flush_ms = 100 ms)."
        )
    return notes


def rows_for(results: list[tuple[int, Case, list[Timing]]]) -> list[Row]:
    """Table rows: per broker setting and case, end-to-end items/s and its parts."""
    out = []
    for max_batches, case, timings in results:
        tag = f"{case.label}, max {max_batches} batches/session, {case.items:,} items"
        headline = case.headline
        out += [
            Row(
                STEP,
                f"{tag}: items/s retired (worker start -> job completed)",
                tuple(t.rate for t in timings),
                target=f">= {ITEMS_TARGET:,}" if headline else "",
                at_least=ITEMS_TARGET if headline else None,
            ),
            Row(
                STEP,
                f"{tag}: tokens/s retired",
                tuple(t.rate * case.tokens for t in timings),
            ),
            Row(
                STEP,
                f"{tag}: items/s handed out (worker start -> all handed out)",
                tuple(t.items / t.handed_s for t in timings),
            ),
            Row(
                STEP,
                f"{tag}: items/s from the first hand-out to job completed",
                tuple(t.steady_rate for t in timings),
            ),
        ]
        if headline or case.repeat > 1:
            out += [
                Row(
                    STEP,
                    f"{tag}: worker start -> first hand-out, s",
                    tuple(t.first_out_s for t in timings),
                ),
                Row(STEP, f"{tag}: peak items in flight", tuple(t.peak_in_flight for t in timings)),
            ]
            for label in CPU_OF:
                out.append(
                    Row(
                        STEP,
                        f"{tag}: CPU of {label} per result, µs (worker start -> job completed)",
                        tuple(1e6 * t.cpu[label] / t.items for t in timings),
                    )
                )
            for label in timings[0].cpu:
                out.append(
                    Row(
                        STEP,
                        f"{tag}: CPU of {label}, % of one core (worker start -> job completed)",
                        tuple(t.cpu[label] / t.seconds for t in timings),
                        percent=True,
                    )
                )
    return out
