"""The demand estimate: how many workers a model's pending work needs, and when each job with
a deadline will finish. Arithmetic only, on numbers dispatch measured (docs/dispatch.md,
"Demand and deadlines", has the formulas with an example).

Work is counted in **worker-seconds**: the time one worker of the model takes for it at its
measured rate (gpu/dispatch/worker_rates.py): a job's lane-padded prompt tokens over the
worker's tokens/s, or, where only a line count is known (a job not submitted yet), its items
over the worker's items/s.

`schedule` replays the order dispatch follows (gpu/dispatch/deadline_order.py) on one
worker's capacity: 3 batches in 4 to the first job in slack order (higher priority, then
the least slack: its deadline less its whole work at the workers there are), 1 in 4 to the
oldest job (today's order: jobs by number), all to one job when both orders name it, and all
to the oldest while no job has a deadline or a priority. It gives T_k, the worker-seconds
until job k is done. With n workers everything goes n times as fast, so:

* job k's projected finish is `now + T_k / n`; `ceil(T_k / (d_k - now))` workers make it;
* `workers_needed` = max(ceil(W / horizon_s), max over deadline jobs k of
  ceil(T_k / max(d_k - now, LATE_FLOOR_S))), W all the pending and in-flight work; at least 1
  while anything is pending or in flight, 0 when nothing is, and the workers there are now
  (at least 1) while no rate is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu.dispatch.deadline_order import DEADLINE_RUN

LATE_FLOOR_S = 10.0  # the least time left counted for a deadline that is near or past
SLACK_SHARE = DEADLINE_RUN / (DEADLINE_RUN + 1)  # of the batches, while today's order differs


@dataclass(frozen=True)
class JobWork:
    """One unfinished job's work still to do, of one model; `deadline_s` inf: none."""

    job_no: int
    deadline_s: float  # wall seconds since the epoch
    priority: int
    items: int  # pending and in flight
    tokens: int | None  # lane-padded; None: not known (a job not stored yet: its items count)
    whole_s: float | None = None  # its whole work (the slack order's); None: `items`, `tokens`


@dataclass(frozen=True)
class Rate:
    """One worker's measured speed on a model; None where not measured yet."""

    items_per_s: float | None
    tokens_per_s: float | None

    @property
    def known(self) -> bool:
        return bool(self.tokens_per_s) and bool(self.items_per_s)  # measured together

    def seconds(self, items: int, tokens: int | None = None) -> float:
        """Worker-seconds for this work: its tokens at tokens/s, or, with no token count, its
        items at items/s. Only where `known`."""
        if tokens is not None:
            return tokens / (self.tokens_per_s or math.nan)
        return items / (self.items_per_s or math.nan)


@dataclass(frozen=True)
class Projection:
    """A deadline job's projected finish (wall seconds; None with no worker) and what it
    takes to finish in time (`workers_to_finish`: None when the deadline has passed)."""

    job_no: int
    deadline_s: float
    finish_s: float | None
    workers: int
    workers_to_finish: int | None

    @property
    def at_risk(self) -> bool:
        return self.finish_s is None or self.finish_s > self.deadline_s


def ceil_workers(work_s: float, window_s: float) -> int:
    return max(0, math.ceil(work_s / window_s - 1e-9))


def schedule(jobs: list[JobWork], rate: Rate, workers: int) -> dict[int, float]:
    """Per job: T, the worker-seconds until it is done in dispatch's order (module
    docstring), on the capacity of one worker. Only where `rate.known`."""
    left = {j.job_no: rate.seconds(j.items, j.tokens) for j in jobs}
    whole = {j.job_no: j.whole_s if j.whole_s is not None else left[j.job_no] for j in jobs}
    n = max(1, workers)
    ranked = [j for j in jobs if math.isfinite(j.deadline_s) or j.priority]
    slack = sorted(
        ranked, key=lambda j: (-j.priority, j.deadline_s - whole[j.job_no] / n, j.job_no)
    )
    oldest = sorted(jobs, key=lambda j: j.job_no)
    done: dict[int, float] = {}
    clock = 0.0
    s = o = 0
    while len(done) < len(jobs):
        while s < len(slack) and slack[s].job_no in done:
            s += 1
        while oldest[o].job_no in done:
            o += 1
        first, old = (slack[s].job_no if s < len(slack) else None), oldest[o].job_no
        if first is None or first == old:
            shares = {old: 1.0}
        else:
            shares = {first: SLACK_SHARE, old: 1.0 - SLACK_SHARE}
        step = min(left[job] / share for job, share in shares.items())
        clock += step
        for job, share in shares.items():
            left[job] -= step * share
            if left[job] <= 1e-9 * (1.0 + step):
                done[job] = clock
    return done


def workers_needed(
    jobs: list[JobWork],
    total_s: float | None,
    busy: bool,
    workers: int,
    rate: Rate,
    now_s: float,
    horizon_s: float,
) -> int:
    """The documented N (module docstring). `jobs`: every job with work left, with a deadline
    or not; `total_s`: all the model's pending and in-flight work in worker-seconds (None:
    rate unknown); `busy`: anything pending or in flight."""
    if not busy:
        return 0
    if total_s is None or not rate.known:
        return max(1, workers)
    need = ceil_workers(total_s, horizon_s)
    finish = schedule(jobs, rate, workers)
    for job in jobs:
        if math.isfinite(job.deadline_s):
            window_s = max(job.deadline_s - now_s, LATE_FLOOR_S)
            need = max(need, ceil_workers(finish[job.job_no], window_s))
    return max(1, need)


def project(jobs: list[JobWork], workers: int, rate: Rate, now_s: float) -> list[Projection]:
    """Each deadline job's finish with `workers` (module docstring), in job order. `jobs`:
    every job with work left. Only where `rate.known`."""
    finish = schedule(jobs, rate, workers)
    answer = []
    for job in jobs:
        if not math.isfinite(job.deadline_s):
            continue
        t = finish[job.job_no]
        left_s = job.deadline_s - now_s
        needed = max(1, ceil_workers(t, left_s)) if left_s > 0 else None
        end = now_s + t / workers if workers else None
        answer.append(Projection(job.job_no, job.deadline_s, end, workers, needed))
    return answer


NEW_JOB = 1 << 62  # the job number a job not submitted yet goes by: the newest


def project_new(
    info: dict, model: str, items: int, deadline_s: float, priority: int, now_s: float
) -> Projection | None:
    """The projection of a job not stored yet, of `items` lines of `model`, among the jobs
    dispatch's status answer (`info`, BROKER_INFO) lists in `work_jobs` (every job with work
    left, for its `demand`'s model). None when no rate is measured for the model (no guess)."""
    row = info.get("demand", {}).get(model)
    if row is None:
        return None
    rate = Rate(row["worker_items_per_s"], row["worker_tokens_per_s"])
    if not rate.known:
        return None
    jobs = [
        JobWork(
            int(no),
            math.inf if j["deadline_s"] is None else j["deadline_s"],
            j["priority"],
            j["items"],
            j["tokens"],
            j["whole_s"],
        )
        for no, j in info.get("work_jobs", {}).get(model, {}).items()
    ]
    new = JobWork(NEW_JOB, deadline_s, priority, items, None)
    mine = project([*jobs, new], row["workers"], rate, now_s)
    return next(p for p in mine if p.job_no == NEW_JOB)
