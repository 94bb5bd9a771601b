"""What dispatch reports about itself: the metrics it pushes (docs/metrics.md) and the
BROKER_INFO answer of `status` (docs/wire.md). Read-only views of the stage's state."""

from __future__ import annotations

import collections
import time

import numpy as np

from gpu.dispatch.demand_view import ModelDemand, oldest_ages
from gpu.dispatch.sessions import WORKER_FIGURES
from pipeline.core import item_seq
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.process.stage_restarts import read_restarts
from pipeline.telemetry.metric_catalogue import RECLAIM_CAUSES

STATUS_LEASES = 20  # the oldest leases named in the status answer
STATUS_SLOTS = 16  # slots named per lease there


REFUSED_KINDS = ("results", "claims")  # refused for want of a valid work token


def dispatch_metrics(stage, now: float) -> dict:
    """Queues, queue age, workers, dispatches, reclaims and dead letters (docs/metrics.md)."""
    wall_s = time.time()
    models = [m.name for m in stage.settings.models]
    queued: collections.Counter = collections.Counter()
    tokens: collections.Counter = collections.Counter()
    oldest = oldest_ages(stage, wall_s)
    for q in stage.state.queue_depth():
        queued[(q.model, str(q.lane))] += q.waiting
        tokens[(q.model, str(q.lane))] += q.waiting * q.lane
    sessions = collections.Counter(dict.fromkeys(models, 0))
    in_flight: collections.Counter = collections.Counter()
    leases: collections.Counter = collections.Counter()
    figures: dict[str, dict] = {
        "fabric_worker_prompt_tokens_total": {},
        "fabric_worker_engine_tokens_per_second": {},
        "fabric_worker_idle_seconds_total": {},
        "fabric_worker_engine_concurrency": {},
        "fabric_worker_upstream_retries_total": {},
    }
    for session_id, session in stage.sessions.items():
        if not session.model:
            continue  # reloaded from the dispatch file; not registered again yet
        key = (session.model, session_id)
        sessions[session.model] += 1
        in_flight[key] += 0
        leases[key] += 0
        for name, field_name in zip(figures, WORKER_FIGURES, strict=True):
            if field_name in session.reported:
                figures[name][key] = session.reported[field_name]
    for batch in stage.state.leases():  # a session serves one model: its batches'
        key = (batch.model, batch.session)
        in_flight[key] += len(batch.items)
        leases[key] += 1
    stalled = collections.Counter(dict.fromkeys(models, 0))
    for session_id, session in stage.sessions.items():
        if session.model and stage.stall.is_stalled(session_id):
            stalled[session.model] += 1
    return {
        "fabric_queued_items": dict(queued),
        "fabric_queued_tokens": dict(tokens),
        "fabric_oldest_queued_item_age_seconds": {(m,): age for m, age in oldest.items()},
        "fabric_items_dispatched_total": {(m,): n for m, n in stage.dispatched.items()},
        "fabric_items_reclaimed_total": {(c,): stage.reclaimed[c] for c in RECLAIM_CAUSES},
        "fabric_dead_letters_total": stage.counts[ItemErrorCode.DEAD_LETTERED],
        "fabric_quarantined_items_total": stage.counts[ItemErrorCode.CORRUPT_INPUT],
        "fabric_deadline_batches_total": getattr(stage.state.deadline_order, "batches", 0),
        "fabric_paused_jobs": len(stage.state.paused.jobs),
        "fabric_paused_items": stage.state.paused.held,
        "fabric_worker_messages_refused_total": {
            (k,): stage.refused.counts[k] for k in REFUSED_KINDS
        },
        "fabric_damaged_segments": len(stage.damaged),
        "fabric_unretired_item_errors": unretired_item_errors(stage),
        "fabric_worker_sessions": {(m,): n for m, n in sessions.items()},
        "fabric_worker_stalled_sessions": {(m,): n for m, n in stalled.items()},
        "fabric_worker_in_flight_items": dict(in_flight),
        "fabric_worker_leases": dict(leases),
        **figures,
        **demand_metrics(stage.demand.models),
    }


def demand_metrics(models: dict[str, ModelDemand]) -> dict:
    """The demand signal per model (gpu/dispatch/demand_view.py); a rate not measured yet
    has no series."""
    rows = models.items()
    return {
        "fabric_workers_needed": {(m,): d.workers_needed for m, d in rows},
        "fabric_items_pending": {(m,): d.items_pending for m, d in rows},
        "fabric_tokens_pending": {(m,): d.tokens_pending for m, d in rows},
        "fabric_oldest_pending_age_seconds": {(m,): d.oldest_pending_age_s for m, d in rows},
        "fabric_worker_items_per_second": {
            (m,): d.worker_items_per_s for m, d in rows if d.worker_items_per_s is not None
        },
        "fabric_worker_tokens_per_second": {
            (m,): d.worker_tokens_per_s for m, d in rows if d.worker_tokens_per_s is not None
        },
        "fabric_jobs_at_risk": {(m,): d.jobs_at_risk for m, d in rows},
    }


def status_queues(stage) -> list[dict]:
    """BROKER_INFO's `queues`: per segment with items waiting, the same count as the metric
    fabric_queued_items (DispatchState.queue_depth), and the segment's model, shape, lane and
    creation time."""
    return [
        {
            "segment": q.segment_id,
            "model": q.model,
            "shape": q.shape,
            "lane": q.lane,
            "queued": q.waiting,
            "created_ns": q.created_ns,
        }
        for q in stage.state.queue_depth()
        if q.waiting > 0
    ]


def unretired_item_errors(stage) -> int:
    """Item errors sent to completion and not yet named by its RETIRED (sent again every 5 s)."""
    return stage.item_errors.unretired_items


def idle_fraction(session, now: float) -> float:
    """Share of the last ~10 s (or of the session's life, if shorter) it held no batch."""
    if len(session.idle_marks) >= 2:
        (t0, idle0), (t1, idle1) = session.idle_marks[0], session.idle_marks[-1]
    else:
        (t0, idle0), (t1, idle1) = (session.started, 0.0), (now, session.idle_s)
    if t1 <= t0:
        return 0.0
    return round(min(1.0, max(0.0, (idle1 - idle0) / (t1 - t0))), 3)


def in_flight_jobs(stage) -> dict[str, int]:
    """Items handed to workers and not yet retired, per job number (as a str: JSON keys)."""
    jobs: collections.Counter = collections.Counter()
    for batch in stage.state.leases():
        numbers, counts = np.unique(item_seq.job_of(batch.items["seq"]), return_counts=True)
        jobs.update(dict(zip(numbers.tolist(), counts.tolist(), strict=True)))
    return {str(job_no): n for job_no, n in jobs.items()}


def broker_status(stage, now: float) -> dict:
    """The BROKER_INFO answer: rates, queues, in flight, dead letters, workers (docs/wire.md)."""
    rate_in = rate_out = 0.0
    if len(stage.samples) >= 2:
        (t0, out0, done0), (t1, out1, done1) = stage.samples[0], stage.samples[-1]
        if t1 > t0:
            rate_in, rate_out = (out1 - out0) / (t1 - t0), (done1 - done0) / (t1 - t0)
    return {
        "rate_in": rate_in,
        "rate_out": rate_out,
        "epoch": stage.epoch,
        "queues": status_queues(stage),
        "in_flight": stage.state.in_flight,
        "in_flight_jobs": in_flight_jobs(stage),
        "handed_out": stage.counts["handed_out"],
        "retired": stage.counts["retired"],
        "registered_holding": len(stage.came_back_holding),
        "reloaded_leases": len(stage.leases.reloaded),
        "dead_lettered": stage.counts[ItemErrorCode.DEAD_LETTERED],
        "corrupt": stage.counts[ItemErrorCode.CORRUPT_INPUT],
        "refused": {kind: stage.refused.counts[kind] for kind in REFUSED_KINDS},
        "unretired_item_errors": unretired_item_errors(stage),
        "dead_letters": list(stage.dead_letters),
        "damaged_segments": dict(stage.damaged),
        "workers": [
            {
                "session": sid,
                "model": s.model,
                "batches": stage.state.session_batches(sid),
                "handed_out": s.handed_out,
                "retired": s.retired,
                "age_s": round(now - s.started, 1),
                "silent_s": round(now - s.last_seen, 1),
                "idle_fraction": idle_fraction(s, now),
                **stage.stall.view(sid, now),
            }
            for sid, s in stage.sessions.items()
        ],
        # local workers that died, and those waiting out a restart backoff (the supervisor's)
        "local_workers": read_restarts(stage.data_dir.root),
        "leases": oldest_leases(stage, now),
        # per model: workers needed and its inputs; per job with a deadline: its projection
        # (gpu/dispatch/demand_view.py, as of the last rescan)
        "demand": {model: row.to_json() for model, row in stage.demand.models.items()},
        "deadline_jobs": {str(job_no): row for job_no, row in stage.demand.jobs.items()},
        "work_jobs": stage.demand.work_jobs,  # per model, per job: its work left
    }


def oldest_leases(stage, now: float, limit: int = STATUS_LEASES) -> list[dict]:
    """The `limit` oldest batches out on lease: who holds which (segment, slots), for how
    long; what a run that does not finish names (bench/chaos.py)."""
    leases = sorted(stage.state.leases(), key=lambda b: b.handed_s)[:limit]
    return [
        {
            "batch_id": b.batch_id,
            "session": b.session,
            "segment": b.segment_id,
            "slots": b.items["slot"][:STATUS_SLOTS].tolist(),
            "items": len(b.items),
            "held_s": round(now - b.handed_s, 1),
            "answered": b.answered,
            "stalled": stage.stall.is_stalled(b.session),
        }
        for b in leases
    ]
