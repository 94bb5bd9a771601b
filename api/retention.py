"""A batch's output and error files follow its broker job's retention.

The job's results stay in the broker for `completion.results_retention_s`
after the job's `finished` mark (pipeline/store/job_files.py; the collector then
removes them, collector/segments.py). A batch's output and error files are
its copy of those results, so they live exactly as long:

| the batch                                   | its files expire at                        |
|---------------------------------------------|--------------------------------------------|
| ended, its job finished                     | the job's finished mark + retention        |
| ended without a job (failed validation, cancelled or expired while validating) | the batch's end time + retention |
| not ended, or its job not finished yet      | not known: `expires_at` stays null         |

Once known, the File objects carry it as `expires_at`; once it has passed,
their records go (GET answers 404, listing omits them), then their bytes and
the batch's copy of its input (`input.jsonl`, when lines were kept out). The
batch object stays, as OpenAI's does. Run by api-0, on the thread that drives
the batches, as often as the collector sweeps (`collector.interval_s`);
every pass reads again what a crash may have left half done.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

from api.batch_record import BatchRecord
from api.batch_store import ERRORS, INPUT_COPY, OUTPUT, BatchStore
from api.file_store import FileStore, output_file_id
from pipeline.store.durable import fsync_dir
from pipeline.store.job_files import JobFiles

log = logging.getLogger("fabric.api")


def files_expire_at(record: BatchRecord, jobs: JobFiles, retention_s: float) -> int | None:
    """When an ended batch's output and error files expire (unix seconds, rounded up so never
    before the job's results), or None while that is not known (see the module table)."""
    if not record.ended:
        return None
    if record.in_progress_at is None:  # never submitted: no job
        ended_at = record.stamp(record.status)
        return None if ended_at is None else math.ceil(ended_at + retention_s)
    finished_ns = jobs.finished_ns(record.id)
    if finished_ns is None:
        return None
    return math.ceil(finished_ns / 1e9 + retention_s)


class OutputRetention:
    """Stamps and removes the output and error files of ended batches (api-0 only)."""

    def __init__(
        self, files: FileStore, batches: BatchStore, data_root: Path, retention_s: float
    ) -> None:
        self.files = files
        self.batches = batches
        self.jobs = JobFiles(data_root)
        self.retention_s = retention_s
        self.due: dict[str, int] = {}  # batch id -> when its files expire (stamped)
        self.settled: set[str] = set()  # batches with nothing left to do

    def step(self, now: float) -> list[str]:
        """Stamp the files whose expiry became known, remove those past it; returns the ids of
        the files removed."""
        for path in self.batches.dir.iterdir():
            batch_id = path.name
            if not batch_id.startswith("batch_") or batch_id in self.settled:
                continue
            if batch_id not in self.due:
                self._look_at(batch_id)
        removed = []
        for batch_id, expires_at in list(self.due.items()):
            if now >= expires_at:
                removed += self._remove(batch_id)
                del self.due[batch_id]
                self.settled.add(batch_id)
        return removed

    def _look_at(self, batch_id: str) -> None:
        record = self.batches.get(batch_id)
        if record is None:
            return
        expires_at = files_expire_at(record, self.jobs, self.retention_s)
        if expires_at is None:
            return
        for which in ("output", "error"):
            file = self.files.get(output_file_id(batch_id, which))
            if file is not None and file.expires_at != expires_at:
                self.files.put(dataclasses.replace(file, expires_at=expires_at))
        self.due[batch_id] = expires_at

    def _remove(self, batch_id: str) -> list[str]:
        """The File records first (the ids are gone), then the bytes."""
        removed = []
        for which in ("output", "error"):
            file = self.files.get(output_file_id(batch_id, which))
            if file is not None:
                self.files.delete(file)
                removed.append(file.id)
        for name in (OUTPUT, ERRORS, INPUT_COPY):
            self.batches.path(batch_id, name).unlink(missing_ok=True)
        fsync_dir(self.batches.path(batch_id))
        return removed
