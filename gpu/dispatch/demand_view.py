"""The demand of each model and the projection of each job with a deadline, as dispatch
sees them now: gathered from its queues, leases, job deadlines and workers' measured rates
once per rescan (`Demand.refresh`), and read by the metrics, the status answer and the
slack order (docs/dispatch.md, "Demand and deadlines"; the arithmetic is
gpu/dispatch/demand.py).

| figure | what |
|--------|------|
| `items_pending`, `tokens_pending` | waiting to be handed out (not out on lease; a paused job's items not counted); tokens lane-padded |
| `oldest_pending_age_s` | the wait of the oldest of them (`fabric_oldest_queued_item_age_seconds`) |
| `worker_items_per_s`, `worker_tokens_per_s` | one worker's measured rate (gpu/dispatch/worker_rates.py); None: not measured yet |
| `workers` | sessions of the model registered now |
| `workers_needed` | gpu/dispatch/demand.py `workers_needed`, over pending and in-flight work |
| `jobs_at_risk` | jobs with a deadline whose projected finish (with `workers`) is past it |

Counting per job reads the job number of every waiting slot, once per rescan, and only
while some unfinished job has a deadline: O(items waiting), numpy-vectorised (about 20 ms per
million waiting items).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gpu.dispatch.demand import JobWork, Projection, Rate, project, workers_needed
from gpu.dispatch.worker_rates import WorkerRates
from pipeline.core import item_seq

BINCOUNT_SPAN = 1 << 16  # job numbers within this span are counted with bincount
ALL_WORK = 0  # `work_jobs`' job while no job has a deadline: all the work, as the oldest job


@dataclass
class ModelDemand:
    """One model's row of the demand (the status answer's `demand`, the metrics)."""

    workers_needed: int
    items_pending: int
    tokens_pending: int
    oldest_pending_age_s: float
    worker_items_per_s: float | None
    worker_tokens_per_s: float | None
    workers: int
    jobs_at_risk: int

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        for key in ("worker_items_per_s", "worker_tokens_per_s"):
            out[key] = None if out[key] is None else round(out[key], 3)
        out["oldest_pending_age_s"] = round(self.oldest_pending_age_s, 3)
        return out


def oldest_ages(stage, wall_s: float) -> dict[str, float]:
    """Per model: how long its oldest waiting item has waited (0 when none waits)."""
    oldest = {m.name: 0.0 for m in stage.settings.models}
    for q in stage.state.queue_depth():
        arrived = stage.arrivals.arrived(q.segment_id, q.cursor) if q.waiting else None
        if arrived is not None:
            oldest[q.model] = max(oldest.get(q.model, 0.0), wall_s - arrived)
    return oldest


class Demand:
    """The last refresh's figures; single owner (the dispatch stage)."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.rates = WorkerRates()
        self.models: dict[str, ModelDemand] = {}
        self.jobs: dict[int, dict] = {}  # job number -> its projection (the status answer)
        # model -> job number -> its work left (the status answer's `work_jobs`)
        self.work_jobs: dict[str, dict[str, dict]] = {}
        self._whole: dict[tuple[str, int], tuple[int, int]] = {}  # most (items, tokens) seen

    def refresh(self, stage, now: float) -> None:
        """Gather queues, leases, deadlines and rates; estimate; hand the slack order each
        deadline job's own work in seconds (`DeadlineOrder.lead_s`)."""
        state, wall_now = stage.state, stage.wall(now)
        pending: collections.Counter = collections.Counter()  # (model, "items"|"tokens")
        per_job: collections.Counter = collections.Counter()  # (model, job, "items"|"tokens")
        timed = state.deadline_order is not None and stage.deadlines.any()
        for work in state.queues():
            waiting = work.waiting()
            if not waiting:
                continue
            lane = work.segment.key.lane
            pending[work.model, "items"] += waiting
            pending[work.model, "tokens"] += waiting * lane
            if timed:
                slots = work.unsent_from(work.cursor)
                seqs = work.segment.slots["seq"][slots]
                if len(slots):
                    work.segment.release_slots(int(slots[0]), int(slots[-1]))
                count_jobs(per_job, work.model, item_seq.job_of(seqs), lane)
        flying: collections.Counter = collections.Counter()
        for batch in state.leases():
            flying[batch.model, "items"] += len(batch.items)
            flying[batch.model, "tokens"] += len(batch.items) * batch.lane
            if timed:
                count_jobs(per_job, batch.model, item_seq.job_of(batch.items["seq"]), batch.lane)
        sessions: dict[str, list[str]] = collections.defaultdict(list)
        for session_id, session in stage.sessions.items():
            if session.model:
                sessions[session.model].append(session_id)
        self.rates.keep_only(set(stage.sessions))
        jobs = self._jobs(stage, per_job, now)
        oldest = oldest_ages(stage, wall_now)
        models = {m.name for m in stage.settings.models} | {m for m, _ in pending | flying}
        self.models, self.jobs, self.work_jobs, lead_s = {}, {}, {}, {}
        for model in sorted(models):
            rate = self.rates.per_worker(model, sessions[model])
            items = pending[model, "items"] + flying[model, "items"]
            tokens = pending[model, "tokens"] + flying[model, "tokens"]
            total_s = rate.seconds(items, tokens) if rate.known else None
            workers = len(sessions[model])
            mine = [self._sized(model, job, rate) for job in jobs.get(model, [])]
            need = workers_needed(mine, total_s, items > 0, workers, rate, wall_now, self.horizon_s)
            projections = project(mine, workers, rate, wall_now) if rate.known else []
            if rate.known:
                everything = [JobWork(ALL_WORK, math.inf, 0, items, tokens)] if items else []
                ahead = mine or everything  # jobs counted only while one has a deadline
                self.work_jobs[model] = {str(j.job_no): work_row(j) for j in ahead}
                for job in mine:  # the slack order's lead: the whole work at these workers
                    lead_s[job.job_no] = (job.whole_s or 0.0) / max(1, workers)
            due = [j for j in mine if math.isfinite(j.deadline_s)]
            unknown = [Projection(j.job_no, j.deadline_s, None, workers, None) for j in due]
            for p in projections or unknown:
                self._keep(model, p, rate.known)
            self.models[model] = ModelDemand(
                need,
                pending[model, "items"],
                pending[model, "tokens"],
                oldest.get(model, 0.0),
                rate.items_per_s,
                rate.tokens_per_s,
                workers,
                sum(1 for p in projections if p.at_risk),
            )
        if state.deadline_order is not None:
            state.deadline_order.lead_s = lead_s

    def _jobs(self, stage, per_job: collections.Counter, now: float) -> dict[str, list[JobWork]]:
        """Per model: its unfinished jobs with work left (a deadline or not), and the most
        work seen of each (`_whole`: its whole work once it is all written)."""
        keys = sorted({(model, job) for model, job, _ in per_job})
        whole = {key: self._whole.get(key, (0, 0)) for key in keys}
        self._whole = whole  # finished jobs are forgotten
        if not keys:
            return {}
        numbers = np.array([job for _, job in keys], np.int64)
        deadlines = stage.deadlines.of(numbers, now)
        priorities = stage.deadlines.priorities(numbers)
        answer: dict[str, list[JobWork]] = collections.defaultdict(list)
        for key, deadline, priority in zip(keys, deadlines, priorities, strict=True):
            model, job = key
            items, tokens = per_job[model, job, "items"], per_job[model, job, "tokens"]
            whole[key] = (max(whole[key][0], items), max(whole[key][1], tokens))
            due = float(deadline) if np.isfinite(deadline) else math.inf  # nan: not known yet
            answer[model].append(JobWork(job, due, int(priority), items, tokens))
        return answer

    def _sized(self, model: str, job: JobWork, rate: Rate) -> JobWork:
        """`job` with its whole work in seconds (None while no rate is measured)."""
        if not rate.known:
            return job
        items, tokens = self._whole.get((model, job.job_no), (job.items, job.tokens or 0))
        return dataclasses.replace(job, whole_s=rate.seconds(items, tokens))

    def _keep(self, model: str, p: Projection, measured: bool) -> None:
        """The job's projection; a job of several models finishes with the latest."""
        before = self.jobs.get(p.job_no)
        row = {
            "model": model,
            "deadline_s": p.deadline_s,
            "projected_finish_s": p.finish_s,
            "measured": measured,  # False: no rate measured for the model yet, no projection
            "at_risk": p.at_risk if measured else None,
            "workers": p.workers,
            "workers_to_finish": p.workers_to_finish,
        }
        if before is None or _finish(row) > _finish(before):
            self.jobs[p.job_no] = row

    def rate(self, model: str) -> Rate:
        row = self.models.get(model)
        if row is None:
            return Rate(None, None)
        return Rate(row.worker_items_per_s, row.worker_tokens_per_s)


def work_row(job: JobWork) -> dict:
    """A job's work left as the status answer's `work_jobs` lists it (a deadline of inf is
    null in JSON): what a projection of a job submitted now counts ahead of it."""
    deadline = job.deadline_s if math.isfinite(job.deadline_s) else None
    return {
        "deadline_s": deadline,
        "priority": job.priority,
        "items": job.items,
        "tokens": job.tokens,
        "whole_s": job.whole_s,
    }


def _finish(row: dict) -> float:
    return math.inf if row["projected_finish_s"] is None else row["projected_finish_s"]


def count_jobs(counter: collections.Counter, model: str, jobs: np.ndarray, lane: int) -> None:
    """Add each job's items (and lane-padded tokens) among `jobs` (a job number per item)."""
    if not len(jobs):
        return
    low = int(jobs.min())
    span = int(jobs.max()) - low + 1
    if span <= BINCOUNT_SPAN:  # job numbers close together: a count, not a sort
        per_job = np.bincount(jobs - low, minlength=span)
        numbers = np.flatnonzero(per_job)
        counts, numbers = per_job[numbers], numbers + low
    else:
        numbers, counts = np.unique(jobs, return_counts=True)
    for job, n in zip(numbers.tolist(), counts.tolist(), strict=True):
        counter[model, job, "items"] += n
        counter[model, job, "tokens"] += n * lane
