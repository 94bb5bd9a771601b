"""The job registry: one directory per job, written before any acknowledgement.

| path                               | what                                              |
|------------------------------------|---------------------------------------------------|
| `jobs/next-job-no`                 | DurableCounter of job numbers (1, 2, ...)         |
| `jobs/<job_id>/job.json`           | id, number, created_ns, chunk_lines, deliver, checksum; written once, atomically (ingest/job_record.py) |
| `jobs/<job_id>/chunks.log`         | RecordLog of chunk events (below)                 |

Chunk events, in order of their durability:

| record                                                         | meaning |
|----------------------------------------------------------------|---------|
| `{"e": "accept", "c", "first", "last", "ns"}`                  | chunk c (lines first..last) may have items in the log from here on |
| `{"e": "commit", "c", "first", "last", "lines", "ids", "stored", "errors", "final"}` | every item of chunk c is durable; `lines`/`ids` map line numbers to custom_ids; `errors` are the rejected lines |
| `{"e": "state", "state"}`                                      | the job changed state |

A job's item index is its line number minus one, and an item's seq in the
log is `job_no << 32 | index`, so a retried chunk carries the same seqs.
The registry has one owner (the front); it batches appends and makes them
durable with `flush()`, before the producer hears anything.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.custom_ids import CustomIdSet
from ingest.job_record import encode_job_record, read_job_record
from pipeline.counter import DurableCounter
from pipeline.durable import write_whole
from pipeline.errors import IngestError
from pipeline.records import RecordLog
from pipeline.segment import disk_error

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z: "$" would allow a final newline
STATES = ("validating", "queued", "in_progress", "completed", "cancelled", "failed")
DELIVER_FILE = "file"
DELIVER_VECTORS = "vectors"


def seq_of(job_no: int, index: int) -> int:
    return (job_no << 32) | index


def parse_deliver(text: str) -> str:
    """Where a job's results go: "file" (results clients), "vectors" (the vector store named
    after each result's model) or "vectors:STORE". Returns the canonical form."""
    kind, _, store = str(text).partition(":")
    if kind == DELIVER_FILE and not store:
        return DELIVER_FILE
    if kind == DELIVER_VECTORS:
        if not store:
            return DELIVER_VECTORS
        if JOB_ID.match(store):
            return f"{DELIVER_VECTORS}:{store}"
    raise IngestError(
        f"deliver {text!r} is not understood: use 'file', 'vectors' (a store named after "
        "the model) or 'vectors:STORE' (a store name of letters, digits, '.', '_' or '-')"
    )


def check_job_id(job_id: str) -> str:
    if not JOB_ID.match(job_id):
        raise IngestError(
            f"job id {job_id!r} is not allowed: use 1-64 characters of letters, digits, "
            f"'.', '_' or '-', starting with a letter or digit"
        )
    return job_id


@dataclass
class ChunkState:
    first: int
    last: int
    accepted_ns: int
    committed: dict[str, Any] | None = None


@dataclass
class Job:
    """One job's durable record and the front's view of it."""

    job_id: str
    job_no: int
    created_ns: int
    chunk_lines: int
    directory: Path
    journal: RecordLog
    chunks: dict[int, ChunkState] = field(default_factory=dict)
    custom_ids: CustomIdSet = field(default_factory=CustomIdSet)
    state: str = "validating"
    deliver: str = DELIVER_FILE
    stored: int = 0
    rejected: int = 0

    def _apply(self, record: dict[str, Any], digests=None) -> None:
        kind = record["e"]
        if kind == "accept":
            self.chunks.setdefault(
                record["c"], ChunkState(record["first"], record["last"], record["ns"])
            )
        elif kind == "commit":
            chunk = self.chunks.setdefault(
                record["c"], ChunkState(record["first"], record["last"], 0)
            )
            if chunk.committed is None:
                # Kept in memory: counts and bad lines only. The custom_ids live in
                # the digest set; the journal has the rest.
                chunk.committed = {k: record[k] for k in ("stored", "errors", "final")}
                self.stored += record["stored"]
                self.rejected += len(record["errors"])
                self.custom_ids.add(record["ids"], digests=digests)
        elif kind == "state":
            self.state = record["state"]

    def accept(self, chunk: int, first: int, last: int, now_ns: int | None = None) -> None:
        """Record that chunk `chunk` may start landing in the log (durable at flush)."""
        record = {
            "e": "accept",
            "c": chunk,
            "first": first,
            "last": last,
            "ns": now_ns or time.time_ns(),
        }
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
    ) -> None:
        """Record that every item of `chunk` is durable (durable at flush).

        `digests` are those of `ids` (ingest.custom_ids.digests), if known.
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
        self.journal.append(record)
        self._apply(record, digests)
        if self.state == "validating" and self.all_committed():
            self.set_state("queued")

    def all_committed(self) -> bool:
        """True once the final chunk and every chunk before it are committed."""
        finals = [
            c for c, s in self.chunks.items() if s.committed is not None and s.committed["final"]
        ]
        if not finals:
            return False
        return all(
            (s := self.chunks.get(c)) is not None and s.committed is not None
            for c in range(finals[0] + 1)
        )

    def commit_pending(self, chunk: int) -> bool:
        """True while chunk's commit record is written but not yet durable."""
        return any(r["e"] == "commit" and r["c"] == chunk for r in self.journal.pending)

    def set_state(self, state: str) -> None:
        record = {"e": "state", "state": state}
        self.journal.append(record)
        self._apply(record)

    def error_records(self) -> list[dict[str, Any]]:
        return [
            e for c in sorted(self.chunks) if (r := self.chunks[c].committed) for e in r["errors"]
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "deliver": self.deliver,
            "stored": self.stored,
            "rejected": self.rejected,
            "chunks_committed": sum(1 for c in self.chunks.values() if c.committed is not None),
        }


class JobRegistry:
    """All jobs under `<data_dir>/jobs`, loaded lazily; one owner."""

    def __init__(self, data_root: Path) -> None:
        self.root = Path(data_root) / "jobs"
        self.root.mkdir(parents=True, exist_ok=True)
        self._counter = DurableCounter(self.root / "next-job-no")
        self._jobs: dict[str, Job] = {}
        self._dirty: set[str] = set()

    def get(self, job_id: str) -> Job | None:
        """The job, from memory or disk; None if it was never created."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        directory = self.root / check_job_id(job_id)
        try:
            meta = read_job_record(directory)  # JobRecordError: damaged, refused
        except FileNotFoundError:
            return None
        journal = RecordLog(directory / "chunks.log")
        job = Job(
            job_id, meta["job_no"], meta["created_ns"], meta["chunk_lines"], directory, journal
        )
        job.deliver = meta.get("deliver", DELIVER_FILE)
        for record in journal.records:
            job._apply(record)
        self._jobs[job_id] = job
        return job

    def create(
        self, job_id: str, chunk_lines: int, deliver: str = DELIVER_FILE, source: str = ""
    ) -> Job:
        """Create a job durably (directory, job.json, empty journal); its chunks have
        `chunk_lines` lines and its results go where `deliver` says (`parse_deliver`).
        `source`: the absolute path of the input file on the producer's host, if it sent one
        (`vectors search` reads the text of a hit's line back from it when it can)."""
        check_job_id(job_id)
        directory = self.root / job_id
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
        try:
            directory.mkdir(exist_ok=True)
            write_whole(directory / "job.json", encode_job_record(meta), also_sync=(self.root,))
        except OSError as exc:  # a full disk: nothing of the job exists; the producer retries
            raise disk_error(exc, directory / "job.json", "creating the job") from exc
        job = Job(
            job_id, job_no, created_ns, chunk_lines, directory, RecordLog(directory / "chunks.log")
        )
        job.deliver = deliver
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

    def job_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / "job.json").exists())

    def close(self) -> None:
        for job in self._jobs.values():
            job.journal.close()
        self._jobs.clear()
