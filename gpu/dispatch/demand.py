"""The demand estimate: how many workers a model's pending work needs, and when each job with
a deadline will finish. Arithmetic only, on numbers dispatch measured (docs/dispatch.md,
"Demand and deadlines", has the formulas with an example).

Work is counted in **worker-seconds**: the time one worker of the model takes for it at its
measured rate (gpu/dispatch/worker_rates.py): a job's lane-padded prompt tokens over the
worker's tokens/s, or, where only a line count is known (a job not submitted yet), its items
over the worker's items/s.

* `workers_needed`: the least N for which, with N workers, every job with a deadline is done
  by it (taking them in deadline order, the order that meets the most deadlines) and all
  the work is done within `horizon_s`:

      N = max(ceil(W / horizon_s), max over deadline jobs k of ceil(A_k / (d_k - now)))

  W: all pending and in-flight work; A_k: the work of the jobs due by d_k, plus the share
  other work takes meanwhile (`with_share`); `d_k - now` is at least `LATE_FLOOR_S`. At
  least 1 while anything is pending or in flight; 0 when nothing is; the workers there are
  now (at least 1) while the rate is not measured yet.
* `project`: each deadline job's finish with the N workers there are, in slack order
  (dispatch's: gpu/dispatch/deadline_order.py), and the workers that would finish it in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu.dispatch.deadline_order import DEADLINE_RUN

LATE_FLOOR_S = 10.0  # the least time left counted for a deadline that is near or past


@dataclass(frozen=True)
class JobWork:
    """One unfinished job's work still to do, of one model."""

    job_no: int
    deadline_s: float  # wall seconds since the epoch
    priority: int
    items: int  # pending and in flight
    tokens: int | None  # lane-padded; None: not known (a job not stored yet: its items count)


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


def with_share(ahead_s: float, other_s: float) -> float:
    """Worker-seconds until `ahead_s` of deadline-ordered work is done while `other_s` of work
    without a deadline also waits: dispatch gives it one batch in DEADLINE_RUN + 1 (the
    minimum share), so up to ahead_s / DEADLINE_RUN of it goes meanwhile."""
    return ahead_s + min(other_s, ahead_s / DEADLINE_RUN)


def ceil_workers(work_s: float, window_s: float) -> int:
    return max(0, math.ceil(work_s / window_s - 1e-9))


def slack_key(job: JobWork, own_s: float, workers: int) -> tuple[int, float]:
    """Dispatch's order among deadline jobs: higher priority, then less slack (the deadline
    less the job's own work at the workers there are: the common `now` cancels out)."""
    return (-job.priority, job.deadline_s - own_s / max(1, workers))


def workers_needed(
    jobs: list[JobWork],
    total_s: float | None,
    busy: bool,
    workers: int,
    rate: Rate,
    now_s: float,
    horizon_s: float,
) -> int:
    """The documented N (module docstring). `jobs`: the deadline jobs; `total_s`: all the
    model's pending and in-flight work in worker-seconds (None: rate unknown); `busy`:
    anything pending or in flight."""
    if not busy:
        return 0
    if total_s is None or not rate.known:
        return max(1, workers)
    need = ceil_workers(total_s, horizon_s)
    timed = sorted(jobs, key=lambda j: j.deadline_s)
    other_s = max(0.0, total_s - sum(rate.seconds(j.items, j.tokens) for j in timed))
    ahead_s = 0.0
    for job in timed:
        ahead_s += rate.seconds(job.items, job.tokens)
        window_s = max(job.deadline_s - now_s, LATE_FLOOR_S)
        need = max(need, ceil_workers(with_share(ahead_s, other_s), window_s))
    return max(1, need)


def project(
    jobs: list[JobWork], total_s: float, workers: int, rate: Rate, now_s: float
) -> list[Projection]:
    """Each deadline job's finish with `workers`, in slack order (dispatch's): the work of
    the jobs before it and its own, plus the minimum share of other work (`with_share`),
    spread over the workers. Only where `rate.known`."""
    own = {j.job_no: rate.seconds(j.items, j.tokens) for j in jobs}
    other_s = max(0.0, total_s - sum(own.values()))
    answer = []
    ahead_s = 0.0
    for job in sorted(jobs, key=lambda j: slack_key(j, own[j.job_no], workers)):
        ahead_s += own[job.job_no]
        work_s = with_share(ahead_s, other_s)
        finish = now_s + work_s / workers if workers else None
        left_s = job.deadline_s - now_s
        needed = max(1, ceil_workers(work_s, left_s)) if left_s > 0 else None
        answer.append(Projection(job.job_no, job.deadline_s, finish, workers, needed))
    return answer


NEW_JOB = -1  # the job number a job not submitted yet goes by in `project_new`


def project_new(
    info: dict, model: str, items: int, deadline_s: float, priority: int, now_s: float
) -> Projection | None:
    """The projection of a job not stored yet, of `items` lines of `model`, among the jobs
    dispatch's status answer (`info`, BROKER_INFO) lists: its `demand`, `work_left` and
    `deadline_jobs`. None when no rate is measured for the model (no guess)."""
    row = info.get("demand", {}).get(model)
    if row is None:
        return None
    rate = Rate(row["worker_items_per_s"], row["worker_tokens_per_s"])
    if not rate.known:
        return None
    left = info.get("work_left", {}).get(model, {"items": 0, "tokens": 0})
    jobs = [
        JobWork(int(no), j["deadline_s"], j["priority"], j["items"], j["tokens"])
        for no, j in info.get("deadline_jobs", {}).items()
        if j["model"] == model
    ]
    new = JobWork(NEW_JOB, deadline_s, priority, items, None)
    total_s = rate.seconds(left["items"], left["tokens"]) + rate.seconds(items)
    mine = project([*jobs, new], total_s, row["workers"], rate, now_s)
    return next(p for p in mine if p.job_no == NEW_JOB)
