"""A job's status as completion answers JOB_STATUS (and heads RESULT_PAGE and CANCELLED with).

Reads only: the job's view (collector/job_view.py), its exact counters in the
completion log, and whether it has finished. Nothing here writes a file:
a job finishes where it finishes (collector/completion/finishing.py).

Its state is `pipeline.core.job_states.job_state` of these facts (the table of facts
and states is there). A job cancelled at its deadline (its cancel mark says so:
pipeline/store/job_files.py) stays `queued` or `in_progress` while its last items are
retired, as its batch stays `in_progress` over HTTP, and then reads `expired`, as its
batch does (pipeline/core/job_states.py `OPENAI_STATUS`).

`done` is the number of lines whose every part has a result or an error
result (a line of one part: its item); `fanout` gives the job's lines of
several parts and their parts, a detail (docs/completion.md, "Lines and parts").
`usage` is the job's token totals over its results (error results count
nothing), each result counted once (collector/completion/job_results.py):
`prompt_tokens`, `completion_tokens` (generated) and `total_tokens`.
`worker_s` is the engine time its results took, from the workers' RESULTS
(collector/completion/worker_time.py). `limits` are the job's caps (pipeline/core/job_limits.py; None: none), and
`stopped` the one it passed (`code`, `limit`, `message` with the numbers), once
completion stopped it (collector/completion/caps.py): it ends `failed`.
"""

from __future__ import annotations

from collector.completion.results_log import CompletionLog
from collector.completion.worker_time import WorkerTime
from collector.job_view import JobView
from pipeline.core.job_states import TERMINAL, job_state


class JobStatus:
    """JOB_INFO of jobs, with each job's rate since this process first answered about it."""

    def __init__(self, completion_log: CompletionLog, worker_time: WorkerTime) -> None:
        self.completion_log = completion_log
        self.worker_time = worker_time
        self.rates: dict[str, tuple[float, int]] = {}  # job -> (first asked, completed then)

    def info(self, view: JobView, finished: bool, now: float) -> dict:
        """The JOB_INFO fields (docs/completion.md) of the job; `finished`: its mark exists."""
        job_id = view.job_id
        log = self.completion_log
        done, failed = log.completed(job_id), log.failed(job_id)
        undelivered = log.undelivered(job_id)
        total = view.total
        cancelled = view.cancelled
        stop = view.stopped if cancelled else None
        state = job_state(
            total,
            done,
            cancelled=cancelled,
            at_deadline=cancelled and view.cancelled_at_deadline,
            stopped=stop is not None,
            finished=finished,
            undelivered=undelivered,
        )
        # results of work done: not error results (a cancel's, rejected lines') that come at once
        first = self.rates.setdefault(job_id, (now, done - failed))
        elapsed = now - first[0]
        rate = max(0, done - failed - first[1]) / elapsed if elapsed > 1 else 0.0
        pending = None if total is None else max(0, total - done)
        prompt_tokens, completion_tokens = log.tokens(job_id)
        return {
            "job": job_id,
            "job_no": view.job_no,
            "exists": True,
            "state": str(state),
            "paused": view.paused and state not in TERMINAL,  # queued items wait (control.py)
            "priority": view.current_priority,
            "total": total,
            "completed": done - failed,
            "failed": failed,
            "pending": pending,
            "undelivered": undelivered,
            "created_ns": view.created_ns,
            "deliver": view.deliver,
            "rate": round(rate, 1),
            "eta_s": round(pending / rate, 1) if rate > 0 and pending else None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "worker_s": round(self.worker_time.of(job_id), 3),
            # `submit --reuse`: lines that took an identical earlier request's result (reuse.py)
            "reused": view.reused_count if view.reuse else None,
            # its models whose lines never reuse, and why (ingest/weights_digest.py)
            "reuse_off": (dict(view.no_fingerprint) or None) if view.reuse else None,
            "limits": view.limits.to_record() or None,
            "stopped": None
            if stop is None
            else {"code": stop.code, "limit": stop.limit, "message": stop.message},
            # counters above are lines; a line of several parts (fan-out) is a detail here
            "fanout": {"lines": len(view.lines), "parts": view.lines.items()}
            if len(view.lines)
            else None,
        }
