"""The job registry: one directory per job, written before any acknowledgement.

The registry writes `jobs/next-job-no`, `jobs/<job_id>/job.json` and
`jobs/<job_id>/chunks.log`; their paths and formats, and the chunk events of
the journal, are in pipeline/store/job_files.py (the one home of the `jobs/`
layout). A job's item index is its line number minus one, and an item's seq
in the log is its `pipeline.core.item_seq.seq_of(job_no, index)`, so a retried
chunk carries the same seqs. The registry has one owner (the front); it
batches appends and makes them durable with `flush()`, before the producer
hears anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ingest.custom_ids import CustomIdSet
from pipeline.core.errors import IngestError
from pipeline.core.job_limits import LimitError, limits_from
from pipeline.core.job_states import JobState, job_state
from pipeline.store.counter import DurableCounter
from pipeline.store.job_files import ChunkEntry, ChunkProgress, JobFiles, Landing
from pipeline.store.job_record import DELIVER_FILE, PRIORITY_LIMIT
from pipeline.store.records import RecordLog
from pipeline.store.segment import disk_error


def parse_priority_field(value: Any) -> int:
    """A chunk's `job_priority` (an integer, higher first; default 0); IngestError if not."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > PRIORITY_LIMIT:
        raise IngestError(
            f"job priority {value!r} is not allowed: send an integer from -{PRIORITY_LIMIT} "
            f"to {PRIORITY_LIMIT} (higher first; 0 is the default)"
        )
    return value


def parse_limits_field(value: Any) -> dict[str, Any]:
    """A chunk's `limits` (pipeline/core/job_limits.py, record keys -> numbers) as the record
    keeps them ({} for none); IngestError naming a bad one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise IngestError(
            f"limits {value!r} is not an object of limits: send e.g. {{'max_errors': 10}}"
        )
    try:
        return limits_from(value).to_record()
    except LimitError as exc:
        raise IngestError(str(exc)) from None


def parse_deadline_field(value: Any) -> float | None:
    """A chunk's `deadline` (wall seconds since the epoch, a positive finite number) or None
    when absent; IngestError naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise IngestError(
            f"deadline {value!r} is not a time: send wall seconds since the epoch (a positive "
            "number), or no deadline"
        )
    if value == float("inf"):
        raise IngestError(f"deadline {value!r} is not a time: send a finite number of seconds")
    return float(value)


class Job:
    """One job's durable record and the front's view of it (its journal folded by
    pipeline.store.job_files.ChunkProgress)."""

    def __init__(
        self,
        job_id: str,
        job_no: int,
        created_ns: int,
        chunk_lines: int,
        directory: Path,
        journal: RecordLog,
        deliver: str = DELIVER_FILE,
    ) -> None:
        self.job_id = job_id
        self.job_no = job_no
        self.created_ns = created_ns
        self.chunk_lines = chunk_lines
        self.directory = directory
        self.journal = journal
        self.deliver = deliver
        self.progress = ChunkProgress()
        self.custom_ids = CustomIdSet()
        self.reuse = False  # `submit --reuse`: its lines take stored results (ingest/reuse_keys.py)

    @property
    def chunks(self) -> dict[int, ChunkEntry]:
        return self.progress.chunks

    @property
    def state(self) -> JobState:
        return self.progress.state

    @property
    def stored(self) -> int:
        return self.progress.stored

    @property
    def rejected(self) -> int:
        return self.progress.rejected

    def _apply(self, record: dict[str, Any], digests=None) -> None:
        if self.progress.apply(record):
            # Kept in memory: counts and bad lines only. The custom_ids live in the digest
            # set; the journal has the rest.
            if digests is None:
                self.custom_ids.add(record["ids"])
            else:  # the front's commit: checked for repeats already (CustomIdSet.add_new)
                self.custom_ids.add_new(digests)

    def accept(
        self,
        chunk: int,
        first: int,
        last: int,
        now_ns: int | None = None,
        landing: Landing | None = None,
    ) -> None:
        """Record that chunk `chunk` may start landing in the log (durable at flush); the front
        records every try it sends on, with its `landing` (pipeline/store/job_files.py)."""
        record = {
            "e": "accept",
            "c": chunk,
            "first": first,
            "last": last,
            "ns": now_ns or time.time_ns(),
        }
        if landing is not None:
            record.update(ep=landing.epoch, life=landing.life, dl=landing.deadline_ns)
        self.journal.append(record)
        self._apply(record)

    def commit(
        self,
        chunk: int,
        lines: list[int],
        ids: list[str],
        stored: int,
        errors: list[dict[str, Any]],
        final: bool,
        digests=None,
        parts: list[list[int]] | None = None,
        names: list[str] | None = None,
        name_ix: list[int] | None = None,
        reuse: dict[str, Any] | None = None,
    ) -> None:
        """Record that every item of `chunk` is durable (durable at flush).

        `digests` are those of `ids` (ingest.custom_ids.digests), if known; passing them
        says the ids were checked for repeats in the job already (the front's recheck).
        `parts` the chunk's fan-out lines, `[line, parts, index of part 1]`; `names` the
        aliases its stored lines gave and `name_ix` which each gave (pipeline/store/job_files.py);
        `reuse` its `reused` lines and request keys `rk` (ingest/reuse_keys.py).
        """
        state = self.chunks[chunk]
        record = {
            "e": "commit",
            "c": chunk,
            "first": state.first,
            "last": state.last,
            "lines": lines,
            "ids": ids,
            "stored": stored,
            "errors": errors,
            "final": final,
        }
        if parts:
            record["parts"] = parts
        if names:
            record["names"] = names
            if name_ix is not None:
                record["name_ix"] = name_ix
        if reuse:
            record.update(reuse)
        self.journal.append(record)
        self._apply(record, digests)
        # the front knows no results: once every chunk is in, its journal says queued (and it
        # answers resent chunks as duplicates), whatever completion says of the job later
        if self.state == JobState.VALIDATING and job_state(self.progress.total) != self.state:
            self.set_state(JobState.QUEUED)

    def all_committed(self) -> bool:
        """True once the final chunk and every chunk before it are committed."""
        return self.progress.all_committed

    def commit_pending(self, chunk: int) -> bool:
        """True while chunk's commit record is written but not yet durable."""
        return any(r["e"] == "commit" and r["c"] == chunk for r in self.journal.pending)

    def check_takes(self, deliver: str, chunk_lines: int) -> None:
        """A chunk is taken only on the terms the job was started with (its `--deliver`, its
        chunk size), and only while the job takes input; IngestError naming the fix otherwise."""
        if deliver != self.deliver:
            raise IngestError(
                f"job {self.job_id} was submitted with --deliver {self.deliver}, this chunk says "
                f"{deliver}; resume it with the same --deliver"
            )
        if chunk_lines != self.chunk_lines:
            raise IngestError(
                f"job {self.job_id} was started with chunks of {self.chunk_lines} lines, this "
                f"chunk says {chunk_lines}; resume it with the same chunk size"
            )
        if self.state not in (JobState.VALIDATING, JobState.QUEUED):
            raise IngestError(f"job {self.job_id} is {self.state}; it takes no more input")

    def set_state(self, state: JobState) -> None:
        record = {"e": "state", "state": str(state)}
        self.journal.append(record)
        self._apply(record)

    def error_records(self) -> list[list[Any]]:
        return self.progress.error_records()

    def summary(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": str(self.state),
            "deliver": self.deliver,
            "stored": self.stored,
            "rejected": self.rejected,
            "chunks_committed": self.progress.committed_chunks,
        }


class JobRegistry:
    """All jobs under `<data_dir>/jobs` (pipeline/store/job_files.py), loaded lazily; one owner."""

    def __init__(self, data_root: Path) -> None:
        self.files = JobFiles(data_root)
        self.root = self.files.root
        self.root.mkdir(parents=True, exist_ok=True)
        self._counter = DurableCounter(self.files.counter_path)
        self._jobs: dict[str, Job] = {}
        self._dirty: set[str] = set()

    def get(self, job_id: str) -> Job | None:
        """The job, from memory or disk; None if it was never created."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        try:
            meta = self.files.read_record(job_id)  # JobRecordError: damaged, refused
        except FileNotFoundError:
            return None
        journal = RecordLog(self.files.journal_path(job_id))
        job = Job(
            job_id,
            meta["job_no"],
            meta["created_ns"],
            meta["chunk_lines"],
            self.files.directory(job_id),
            journal,
            meta.get("deliver", DELIVER_FILE),
        )
        job.reuse = bool(meta.get("reuse", False))
        for record in journal.records:
            job._apply(record)
        self._jobs[job_id] = job
        return job

    def create(
        self,
        job_id: str,
        chunk_lines: int,
        deliver: str = DELIVER_FILE,
        source: str = "",
        deadline: float | None = None,
        priority: int = 0,
        notify: str = "",
        limits: dict[str, Any] | None = None,
        reuse: bool = False,
    ) -> Job:
        """Create a job durably (directory, job.json, empty journal); its chunks have
        `chunk_lines` lines and its results go where `deliver` says (`parse_deliver`).
        `source`: the absolute path of the input file on the producer's host, if it sent one
        (`vectors search` reads the text of a hit's line back from it when it can).
        `deadline`: when the job should be done (wall seconds), if it has one; dispatch
        reads it from the record and serves earlier deadlines first (docs/dispatch.md);
        `priority` (higher first, within a minimum share for the rest) likewise.
        `notify`: the URL completion POSTs the job's end to (`submit --notify`), if any.
        `limits`: the job's caps (`parse_limits_field`), if it has any; completion reads them
        from the record (collector/completion/caps.py). `reuse`: its lines take the stored
        results of identical earlier requests (`submit --reuse`, ingest/reuse_keys.py)."""
        directory = self.files.directory(job_id)  # IngestError: not an allowed id
        job_no = self._counter.next()  # DiskFullError when the disk is full
        created_ns = time.time_ns()
        meta = {
            "job_id": job_id,
            "job_no": job_no,
            "created_ns": created_ns,
            "chunk_lines": chunk_lines,
            "deliver": deliver,
        }
        if source:
            meta["source"] = source
        if deadline is not None:
            meta["deadline"] = parse_deadline_field(deadline)
        if priority:
            meta["priority"] = parse_priority_field(priority)
        if notify:
            meta["notify"] = notify
        if limits:
            meta["limits"] = limits
        if reuse:
            meta["reuse"] = True
        try:
            self.files.write_record(job_id, meta)
        except OSError as exc:  # a full disk: nothing of the job exists; the producer retries
            raise disk_error(exc, self.files.record_path(job_id), "creating the job") from exc
        journal = RecordLog(self.files.journal_path(job_id))
        job = Job(job_id, job_no, created_ns, chunk_lines, directory, journal, deliver)
        job.reuse = reuse
        self._jobs[job_id] = job
        return job

    def unload(self, job: Job) -> bool:
        """Forget a job that takes no more input (its journal keeps everything).

        A job with records not yet flushed stays; returns whether it went.
        """
        if job.job_id in self._dirty:
            return False
        job.journal.close()
        self._jobs.pop(job.job_id, None)
        return True

    def touch(self, job: Job) -> None:
        """Mark a job's journal as needing a flush."""
        self._dirty.add(job.job_id)

    @property
    def dirty(self) -> bool:
        """True while some journal has records `flush()` has not made durable."""
        return bool(self._dirty)

    def flush(self) -> None:
        """Make every pending journal record durable (group commit)."""
        for job_id in sorted(self._dirty):
            self._jobs[job_id].journal.sync()
        self._dirty.clear()

    def close(self) -> None:
        for job in self._jobs.values():
            job.journal.close()
        self._jobs.clear()
