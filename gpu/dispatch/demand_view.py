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
while some unfinished job has a deadline: O(items waiting), numpy-vectorised.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import numpy as np

from gpu.dispatch.demand import JobWork, Projection, Rate, project, workers_needed
from gpu.dispatch.worker_rates import WorkerRates
from pipeline.core import item_seq


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
        self.work_left: dict[str, dict[str, int]] = {}  # model -> pending + in flight

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
        jobs = self._deadline_jobs(stage, per_job, now)
        oldest = oldest_ages(stage, time.time())
        models = {m.name for m in stage.settings.models} | {m for m, _ in pending | flying}
        self.models, self.jobs, self.work_left, lead_s = {}, {}, {}, {}
        for model in sorted(models):
            rate = self.rates.per_worker(model, sessions[model])
            items = pending[model, "items"] + flying[model, "items"]
            tokens = pending[model, "tokens"] + flying[model, "tokens"]
            total_s = rate.seconds(items, tokens) if rate.known else None
            self.work_left[model] = {"items": items, "tokens": tokens}
            workers = len(sessions[model])
            mine = jobs.get(model, [])
            need = workers_needed(mine, total_s, items > 0, workers, rate, wall_now, self.horizon_s)
            projections = []
            if total_s is not None:  # the rate is measured
                projections = project(mine, total_s, workers, rate, wall_now)
            for job in mine:
                if rate.known:
                    lead_s[job.job_no] = rate.seconds(job.items, job.tokens) / max(1, workers)
            unknown = [Projection(j.job_no, j.deadline_s, None, workers, None) for j in mine]
            for job, p in zip(mine, _in_order_of(mine, projections or unknown), strict=True):
                self._keep(model, job, p, rate.known)
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

    def _deadline_jobs(
        self, stage, per_job: collections.Counter, now: float
    ) -> dict[str, list[JobWork]]:
        """Per model: its unfinished jobs with a deadline, and their work left."""
        keys = sorted({(model, job) for model, job, _ in per_job})
        if not keys:
            return {}
        numbers = np.array([job for _, job in keys], np.int64)
        deadlines = stage.deadlines.of(numbers, now)
        priorities = stage.deadlines.priorities(numbers)
        answer: dict[str, list[JobWork]] = collections.defaultdict(list)
        for (model, job), deadline, priority in zip(keys, deadlines, priorities, strict=True):
            if np.isfinite(deadline):
                items, tokens = per_job[model, job, "items"], per_job[model, job, "tokens"]
                answer[model].append(JobWork(job, float(deadline), int(priority), items, tokens))
        return answer

    def _keep(self, model: str, job: JobWork, p: Projection, measured: bool) -> None:
        """The job's projection; a job of several models finishes with the latest."""
        before = self.jobs.get(p.job_no)
        row = {
            "model": model,
            "items": job.items,  # its work left (pending and in flight): what a projection
            "tokens": job.tokens,  # of a job submitted now counts ahead of it
            "priority": job.priority,
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


def _in_order_of(jobs: list[JobWork], projections: list[Projection]) -> list[Projection]:
    by_job = {p.job_no: p for p in projections}
    return [by_job[j.job_no] for j in jobs]


def _finish(row: dict) -> float:
    return math.inf if row["projected_finish_s"] is None else row["projected_finish_s"]


def count_jobs(counter: collections.Counter, model: str, jobs: np.ndarray, lane: int) -> None:
    numbers, counts = np.unique(jobs, return_counts=True)
    for job, n in zip(numbers.tolist(), counts.tolist(), strict=True):
        counter[model, job, "items"] += n
        counter[model, job, "tokens"] += n * lane
