"""Caps: a job that passed one of its limits (pipeline/core/job_limits.py) is stopped.

Completion sees every result and error of a job, so it checks the job's limits
each time the job is given results that are durable (the stage's group commit):
its lines done and failed, its tokens (the counters JOB_INFO shows,
collector/completion/results_log.py) and its worker-seconds
(collector/completion/worker_time.py). A job past a limit is stopped the way a
cancel stops it (collector/completion/cancel.py): its cancel mark is written
with the limit and the numbers (`Stop.mark_text`), and CANCEL_JOB goes to
dispatch, which sends its queued items back as `cancelled` ITEM_ERRORS; intake
turns them into the stop's code (`error_cap`, `budget_exceeded`). Lines in
flight finish and keep their results; once every item is retired the job ends
`failed`, and its `stopped` (JOB_INFO) says which limit and the numbers.
"""

from __future__ import annotations

import logging

import zmq

from collector.completion.cancel import send_cancel
from collector.completion.results_log import CompletionLog
from collector.completion.worker_time import WorkerTime
from collector.job_view import JobView, write_cancel
from pipeline.core.job_limits import Stop
from pipeline.store.segment import disk_error


class CapWatch:
    """Checks the limits of the jobs given results; stops those past one."""

    def __init__(
        self,
        completion_log: CompletionLog,
        worker_time: WorkerTime,
        dispatch: zmq.Socket,
        log: logging.Logger,
    ):
        self.completion_log = completion_log
        self.worker_time = worker_time
        self.dispatch = dispatch
        self.log = log
        self.stopped = 0  # jobs stopped by a limit since the stage started (metrics)

    def check(self, view: JobView) -> Stop | None:
        """Stop the job if it passed a limit (once: a cancelled job is not checked again).
        DiskFullError: the mark is not written (checked again with the next results)."""
        if not view.limits.any or view.cancelled:
            return None
        log = self.completion_log
        prompt, generated = log.tokens(view.job_id)
        done, total = log.completed(view.job_id), view.total
        if total is not None and done >= total:  # nothing left to stop: it completes
            return None
        stop = view.limits.passed(
            done,
            log.failed(view.job_id),
            prompt + generated,
            self.worker_time.of(view.job_id),
        )
        if stop is None:
            return None
        try:
            write_cancel(view, stop=stop)
        except OSError as exc:
            raise disk_error(exc, view.cancel_path, "recording a job's stop") from exc
        self.stopped += 1
        self.log.warning("job %s stopped (%s): %s", view.job_id, stop.code, stop.message)
        send_cancel(view, self.dispatch, self.log)
        return stop
