"""Projected finish against actual finish: a multi-job backlog with deadlines, worked by a
fleet of simulated workers whose number changes while it runs (docs/BENCHMARKS.md).

    python bench/deadline_projection.py [--scale 1.0] [--dir /tmp]

A real broker (`python run.py --config`, no local workers) gets four jobs with deadlines at
once and a fifth a while later, pre-tokenised `/v1/completions` items (64 prompt tokens,
max_tokens 16) for `echo`, worked by `python run.py worker --engine simulated` processes at
`TOKENS_PER_S` each: 2 workers, 4 from `GROW_AT_S`, 2 again from `SHRINK_AT_S` (the other
two drain on SIGTERM); a change counts from when dispatch sees the new number registered. Every `SAMPLE_S` it asks dispatch for its projections (`run.py
status --json`'s `deadline_jobs`) and completion for each job's count (`status JOB`).

For every sample of a job with at least 5% of its items done, the error of the projection
against the job's actual finish (the first sample that sees it done) is given two ways:

* of the job's duration: |projected - actual| / (actual - submitted), the target's measure
  (within 10% once 5% is done);
* of the time it still had: |projected - actual| / (actual - sampled), stricter near the end.

Projections assume the workers there are now, so a sample taken before a change of the
worker count is off by that change; the table shows apart the samples after which the count
held until the job finished.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import machine
from bench.dispatch_common import ENDPOINT, MAX_TOKENS, MODEL, Status, Workers, make_rows
from bench.ingest_broker import BenchBroker
from ingest.submit_client import Producer

TOKENS = 64
TOKENS_PER_S = 12_000.0  # each simulated worker: (64 + 16) tokens per item, 150 items/s
SAMPLE_S = 0.25
GROW_AT_S = 15.0
SHRINK_AT_S = 35.0
LATE_JOB_AT_S = 20.0
# (job, items, deadline after the start in s); the last arrives at LATE_JOB_AT_S
JOBS = [("a", 6000, 50.0), ("b", 3000, 25.0), ("c", 8000, 90.0), ("d", 2000, 120.0)]
LATE_JOB = ("e", 4000, 70.0)


@dataclass
class Track:
    job: str
    total: int
    submitted: float
    deadline: float
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, done, proj
    finished: float | None = None


def submit(broker: BenchBroker, job: str, n: int, deadline: float, seed: int) -> Track:
    started = time.time()
    with Producer(broker.address) as producer:
        report = producer.submit_tokens(
            job,
            MODEL.name,
            make_rows(n, TOKENS, seed),
            endpoint=ENDPOINT,
            max_tokens=MAX_TOKENS,
            deadline=deadline,
        )
    if report.stored != n:
        raise RuntimeError(f"job {job}: {report.stored} of {n} stored: {report.errors[:3]}")
    return Track(job, n, started, deadline)


def run(root: Path, scale: float) -> tuple[list[Track], list[tuple[float, int]]]:
    broker = BenchBroker(root / "broker", [MODEL]).start()
    status = Status(broker)
    steady = Workers(broker, 2, engine="simulated", options=(f"tokens_per_s={TOKENS_PER_S}",))
    extra = Workers(broker, 2, engine="simulated", options=(f"tokens_per_s={TOKENS_PER_S}",))
    changes: list[tuple[float, int]] = []
    try:
        steady.start()
        t0 = time.time()
        changes.append((t0, 2))
        tracks = {
            job: submit(broker, job, int(n * scale), t0 + due * scale, seed)
            for seed, (job, n, due) in enumerate(JOBS)
        }
        late = None
        grown, target = False, 2
        while True:
            now = time.time()
            if late is None and now - t0 >= LATE_JOB_AT_S * scale:
                job, n, due = LATE_JOB
                late = tracks[job] = submit(broker, job, int(n * scale), now + due * scale, 9)
            if not extra.procs and not grown and now - t0 >= GROW_AT_S * scale:
                extra.start()
                grown, target = True, 4
            if extra.procs and now - t0 >= SHRINK_AT_S * scale:
                extra.stop()  # they drain: finish or hand back
                target = 2
            info = status.dispatch()
            if info["demand"][MODEL.name]["workers"] == target != changes[-1][1]:
                changes.append((now, target))  # when dispatch sees the new count
            projections = info.get("deadline_jobs", {})
            for track in tracks.values():
                if track.finished is not None:
                    continue
                info = status.job(track.job)
                done = int(info["completed"]) + int(info["failed"])
                if done >= track.total:
                    track.finished = time.time()
                    continue
                row = projections.get(str(info["job_no"]))
                if row and row["projected_finish_s"] is not None:
                    track.samples.append((now, done, row["projected_finish_s"]))
            if late is not None and all(t.finished is not None for t in tracks.values()):
                return list(tracks.values()), changes
            if now - t0 > 600 * scale:
                raise RuntimeError("the backlog did not drain in 600 s")
            time.sleep(SAMPLE_S)
    finally:
        extra.stop()
        steady.stop()
        status.close()
        broker.stop()
        broker.close()


def errors(track: Track, changes: tuple[float, ...] = ()) -> tuple[list[float], list[float]]:
    """Per sample with 5% done (and no change of the worker count at `changes` between it and
    the job's finish): error of the job's duration, and of the time it still had."""
    assert track.finished is not None
    of_job, of_left = [], []
    for t, done, projected in track.samples:
        if done < 0.05 * track.total or any(t < c <= track.finished for c in changes):
            continue
        miss = abs(projected - track.finished)
        of_job.append(miss / (track.finished - track.submitted))
        of_left.append(miss / max(1e-9, track.finished - t))
    return of_job, of_left


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{100 * float(np.quantile(values, q)):.1f}%"


def report(tracks: list[Track], changes: list[tuple[float, int]]) -> str:
    t0 = changes[0][0]
    moments = tuple(t for t, _ in changes[1:])
    lines = [
        "| job | items | submitted (s) | deadline (s) | finished (s) | at 5% done: error of "
        "the job's duration | all samples from 5%: median / p90 / max of the job's duration "
        "| worker count held to the finish: median / max | of the time left: median / p90 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for track in sorted(tracks, key=lambda t: t.job):
        of_job, of_left = errors(track)
        after, _ = errors(track, moments)
        lines.append(
            f"| {track.job} | {track.total:,} | {track.submitted - t0:.1f} | "
            f"{track.deadline - t0:.0f} | {track.finished - t0:.1f} | "
            f"{100 * of_job[0]:.1f}% | {pct(of_job, 0.5)} / {pct(of_job, 0.9)} / "
            f"{pct(of_job, 1.0)} | {pct(after, 0.5)} / {pct(after, 1.0)} | "
            f"{pct(of_left, 0.5)} / {pct(of_left, 0.9)} |"
            if of_job
            else f"| {track.job} | {track.total:,} | ... | no sample after 5% done |"
        )
    lines.append("")
    lines.append(f"Workers: {', '.join(f'{n} from {t - t0:.1f} s' for t, n in changes)}.")
    for what, cut in (("all samples", ()), ("the worker count held to the finish", moments)):
        every = [e for t in tracks for e in errors(t, cut)[0]]
        within = sum(e <= 0.10 for e in every) / max(1, len(every))
        lines.append(
            f"Samples from 5% done, {what}: {100 * within:.1f}% of {len(every)} within 10% "
            f"of the job's duration; median {100 * statistics.median(every):.1f}%, "
            f"max {100 * max(every):.1f}%."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="items and times x this")
    parser.add_argument("--dir", default=None, help="where the broker's data dir goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        facts = machine.describe(Path(root))
        tracks, changes = run(Path(root), args.scale)
    print(f"command: {machine.command_line()}")
    for key, value in facts.items():
        print(f"{key}: {value}")
    print()
    print(report(tracks, changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
