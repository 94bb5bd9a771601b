"""Job finishing: where a job ends, its completion segments are sealed and `finished` is written.

A job finishes when every item has a result or an error result (`completed`),
or, cancelled, when every item is retired (`cancelled`). That is noticed
where it happens, never in a status or results request (reads never write):

| where | when |
|-------|------|
| the stage's step, after a group commit | a job given results (RESULTS, ITEM_ERRORS: a cancel's too, rejected lines) is done once they are durable |
| the stage's tidy (every second) | a loaded job whose `total` became known after its last result |
| the first tidy of a completion process | every job under `jobs/` not finished: one whose last result was stored before a restart finishes there; one all of whose lines were rejected finishes without anyone asking |

Finishing seals the job's open completion segments and writes
`jobs/<id>/finished` (the wall-clock ns, written whole): the start of the
job's retention (collector/segments.py). On a full disk, again at the next
tidy. The `jobs/` layout is pipeline/store/job_files.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from collector.completion.results_log import CompletionLog
from collector.job_view import JobIndex, JobView
from pipeline.core.errors import FabricError
from pipeline.store.segment import disk_error


class JobFinisher:
    """Takes up unfinished jobs and finishes those that are done. `wall_ns` gives the mark's
    time (the stage's wall clock; tests give a fake one)."""

    def __init__(
        self,
        completion_log: CompletionLog,
        jobs: JobIndex,
        wall_ns: Callable[[], int],
        log: logging.Logger,
        on_end: Callable[[JobView], None] | None = None,
    ) -> None:
        """`on_end`: told of each job finishing, before its mark (`submit --notify`'s event)."""
        self.completion_log = completion_log
        self.jobs = jobs
        self.wall_ns = wall_ns
        self.log = log
        self.on_end = on_end
        self.looked_at: set[str] = set()  # names under jobs/ already considered by `discover`

    def finished(self, job_id: str) -> bool:
        return self.jobs.files.is_finished(job_id)

    def discover(self) -> None:
        """Load every job under jobs/ seen for the first time that has not finished, so that
        it finishes without anyone asking about it. A finished job is not read at all."""
        for name in self.jobs.files.names():
            if name in self.looked_at:
                continue
            self.looked_at.add(name)
            if self.finished(name):
                continue
            try:
                view = self.jobs.view(name)
            except (FabricError, OSError, ValueError) as exc:
                self.log.warning("job %r unreadable: %s", name, exc)
                continue
            if view is not None:
                self.completion_log.load_job(name)

    def finish_if_done(self, view: JobView) -> None:
        """Finish the job if every item has a result (or an error result) and it has not
        finished yet. Its results must be durable (no sync pending). DiskFullError: not
        finished (the caller tries again at its next tidy)."""
        if self.done(view) and not self.finished(view.job_id):
            self.finish(view)

    def done(self, view: JobView) -> bool:
        """Every item of the job has a result (or an error result)."""
        total = view.total
        return total is not None and self.completion_log.completed(view.job_id) >= total

    def finish(self, view: JobView) -> None:
        """Seal the job's completion segments and note when it finished (for retention)."""
        files = self.jobs.files
        self.completion_log.finish_job(view.job_id)
        if self.on_end is not None:
            self.on_end(view)
        try:  # whole or absent: an empty mark would read as finished at time 0
            files.mark_finished(view.job_id, self.wall_ns())
        except OSError as exc:
            path = files.finished_path(view.job_id)
            raise disk_error(exc, path, "noting that the job finished") from exc
        self.log.info("job %s finished", view.job_id)
