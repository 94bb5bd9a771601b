"""Which jobs have a deadline or a priority: dispatch's view of job records and marks.

A job's priority (an integer, higher first, default 0) is the record's
`priority` (`submit --priority`, the HTTP metadata `fabric_priority`) unless a
client changed it (`run.py priority`: the `jobs/<id>/priority` mark, read with
the record, and JOB_CONTROL while dispatch runs: `set_priority`).

A job's deadline (wall seconds since the epoch) is a field of its record,
`jobs/<job_id>/job.json` (pipeline/store/job_record.py), set by `submit --deadline`
or by the api stage from a batch's `expires_at`. The front writes the record
durably before any item of the job is in the log, so the record of every job
dispatch meets in a segment is there to read, after any restart: no message
carries deadlines and nothing here needs its own file.

Records are read once per job: at the first `refresh()` every job directory,
later only directories not seen before (the `jobs/` directory's mtime says
when there are new ones) and those that had no record yet (a job being
created). Job numbers grow with creation, so a number above the highest one
read is a job created since: `of()` looks again (at most every
`LOOK_AGAIN_S`) before it answers "not known yet". Jobs whose `finished`
mark appears are forgotten (the marks are looked at every
`FINISHED_EVERY_S`). Memory: one entry per unfinished job with a deadline,
and the names of the job directories seen.

| `of(job_nos)` answers | meaning |
|-----------------------|---------|
| a number              | the job's deadline |
| `inf`                 | the job has none (or its record is damaged: `run.py check` names it) |
| `nan`                 | no record read for that number yet: ask again later |
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from pipeline.store.job_files import JobFiles
from pipeline.store.job_record import JobRecordError, record_deadline, record_priority

LOOK_AGAIN_S = 0.2  # the least time between two listings of jobs/ for an unknown job number
FINISHED_EVERY_S = 10.0  # how often the `finished` marks of jobs with a deadline are looked at


class JobDeadlines:
    """job_no -> deadline of the unfinished jobs that have one; single owner (dispatch)."""

    def __init__(self, data_root: Path, log: logging.Logger) -> None:
        self.files = JobFiles(data_root)
        self.log = log
        self._deadlines: dict[int, float] = {}  # job_no -> deadline (unfinished jobs)
        self._priorities: dict[int, int] = {}  # job_no -> priority, when not 0 (unfinished)
        self._ids: dict[int, str] = {}  # job_no -> job id, to look for its finished mark
        self._seen: set[str] = set()  # job directories whose record was read (or refused)
        self._highest = 0  # the highest job number read
        self._listed_mtime: int | None = None
        self._listed_at = -math.inf
        self._finished_at = -math.inf

    def any(self) -> bool:
        """True while some unfinished job has a deadline or a priority other than 0."""
        return bool(self._deadlines) or bool(self._priorities)

    def priorities(self, job_nos: np.ndarray) -> np.ndarray:
        """Per job number: its priority (int64; 0 when it has none or is not known yet)."""
        answer = np.zeros(len(job_nos), np.int64)
        if self._priorities:
            for i in np.flatnonzero(np.isin(job_nos, list(self._priorities))).tolist():
                answer[i] = self._priorities[int(job_nos[i])]
        return answer

    def set_priority(self, job_no: int, priority: int, job_id: str | None = None) -> None:
        """A client changed the job's priority (JOB_CONTROL; its mark is written already);
        `job_id`: to look for its `finished` mark, which drops it."""
        if job_id is not None:
            self._ids.setdefault(job_no, job_id)
        if priority:
            self._priorities[job_no] = priority
        else:
            self._priorities.pop(job_no, None)

    def of(self, job_nos: np.ndarray, now: float) -> np.ndarray:
        """Per job number (distinct jobs, not items): its deadline, inf (none) or nan (no
        record read yet). `now`: the caller's monotonic clock (dispatch's step)."""
        job_nos = np.asarray(job_nos, np.int64)
        unknown = len(job_nos) and int(job_nos.max()) > self._highest
        if unknown and now - self._listed_at >= LOOK_AGAIN_S:
            self.refresh(now, list_anyway=True)
        answer = np.full(len(job_nos), np.inf)
        answer[job_nos > self._highest] = np.nan
        for i in np.flatnonzero(np.isin(job_nos, self._known_array())).tolist():
            answer[i] = self._deadlines[int(job_nos[i])]
        return answer

    def _known_array(self) -> np.ndarray:
        return np.fromiter(self._deadlines, np.int64, len(self._deadlines))

    def refresh(self, now: float, list_anyway: bool = False) -> None:
        """Read the records of new job directories; forget jobs that finished (their marks
        are looked at every FINISHED_EVERY_S: one stat per job with a deadline)."""
        if now - self._finished_at >= FINISHED_EVERY_S:
            self._finished_at = now
            for job_no, job_id in list(self._ids.items()):
                if self.files.is_finished(job_id):
                    del self._ids[job_no]
                    self._deadlines.pop(job_no, None)
                    self._priorities.pop(job_no, None)
        try:
            mtime = self.files.root.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._listed_mtime and not list_anyway:
            return
        self._listed_at = now
        complete = True
        for job_id in self.files.names():
            if job_id in self._seen:
                continue
            try:
                meta = self.files.read_record(job_id)
            except FileNotFoundError:  # being created: its record comes next
                complete = False
                continue
            except (JobRecordError, OSError) as exc:  # no deadline; `run.py check` names it
                self.log.warning("job %s: record not read for its deadline: %s", job_id, exc)
                self._seen.add(job_id)
                continue
            self._seen.add(job_id)
            job_no = int(meta["job_no"])
            self._highest = max(self._highest, job_no)
            deadline = record_deadline(meta)
            changed = self.files.priority(job_id)  # a client's change, over the record's
            priority = changed if changed is not None else record_priority(meta)
            if (deadline is not None or priority) and not self.files.is_finished(job_id):
                if deadline is not None:
                    self._deadlines[job_no] = deadline
                if priority:
                    self._priorities[job_no] = priority
                self._ids[job_no] = job_id
        self._listed_mtime = mtime if complete else None  # list again while one is incomplete
