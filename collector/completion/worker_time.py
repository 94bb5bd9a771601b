"""Worker-seconds per job: what a job's results cost in engine time, from the workers' word.

Each RESULTS carries `engine_s`, the seconds the worker's engine ran that batch
(gpu/worker/engine_thread.py; docs/wire.md). Completion shares it over the
batch's items evenly and adds to each job the share of the results it stored
for that job (a duplicate adds nothing, so a resend or a second computation
after a reclaim is not counted twice). A worker's word is bounded: a value that
is not a finite number from 0 to `MAX_ENGINE_S` counts as 0.

A job's total is kept in `jobs/<job_id>/worker-seconds` (pipeline/store/job_files.py),
rewritten atomically at most every `WRITE_EVERY_S` and when the job finishes; a
completion process that is killed loses at most the last second's worth. JOB_INFO
shows it as `worker_s` (`status JOB`), and a job's `max_worker_s` limit stops it
(pipeline/core/job_limits.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pipeline.store.job_files import JobFiles

MAX_ENGINE_S = 86_400.0  # a batch's engine time above a day is not believed
WRITE_EVERY_S = 1.0


def engine_seconds(meta: dict[str, Any]) -> float:
    """A RESULTS message's `engine_s`, bounded (0.0 when absent or not believable)."""
    value = meta.get("engine_s")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) and 0 <= value <= MAX_ENGINE_S else 0.0


class WorkerTime:
    """The worker-seconds of the jobs completion holds, read from and written to their file."""

    def __init__(self, files: JobFiles, log: logging.Logger) -> None:
        self.files = files
        self.log = log
        self.totals: dict[str, float] = {}
        self.changed: set[str] = set()
        self.written_at = 0.0
        self.added_s = 0.0  # worker-seconds added since the stage started (metrics)

    def of(self, job_id: str) -> float:
        if job_id not in self.totals:
            self.totals[job_id] = self.files.read_worker_seconds(job_id)
        return self.totals[job_id]

    def add(self, job_id: str, seconds: float) -> None:
        if seconds > 0:
            self.totals[job_id] = self.of(job_id) + seconds
            self.added_s += seconds
            self.changed.add(job_id)

    def write(self, now: float, job_id: str | None = None) -> None:
        """Write the changed totals once WRITE_EVERY_S has passed (`job_id`: that job's now,
        as it finishes; math.inf: every changed one). A total not written (a full disk) is
        kept to write at the next call."""
        due = now - self.written_at >= WRITE_EVERY_S
        jobs = sorted(self.changed) if due else [j for j in (job_id,) if j in self.changed]
        for job in jobs:
            try:
                self.files.write_worker_seconds(job, self.totals[job])
            except OSError as exc:
                self.log.warning("job %s: worker-seconds not written yet: %s", job, exc)
                continue
            self.changed.discard(job)
        if due:
            self.written_at = now

    def forget(self, job_id: str) -> None:
        """Drop an unloaded job's total (its file holds it)."""
        if job_id not in self.changed:
            self.totals.pop(job_id, None)
