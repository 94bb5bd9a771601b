"""The `jobs/` directory: every file in it, who writes it, and the one reader of each.

| path                         | written by                   | what |
|------------------------------|------------------------------|------|
| `jobs/next-job-no`           | the front (ingest/jobs.py)   | DurableCounter of job numbers (1, 2, ...) |
| `jobs/<job_id>/job.json`     | the front, once, atomically  | the job record (pipeline/store/job_record.py) |
| `jobs/<job_id>/chunks.log`   | the front                    | RecordLog (pipeline/store/records.py) of chunk events (below) |
| `jobs/<job_id>/cancel`       | completion, atomically       | `<job_no> <wall ns>\\n`: a client cancelled the job; `<job_no> <wall ns> expired\\n`: it was cancelled at its deadline (the HTTP API's `completion_window`), and ends `expired`; `<job_no> <wall ns> <code> <limit> <message>\\n`: it passed a limit (pipeline/core/job_limits.py) and ends `failed`; dispatch reads the job number at start |
| `jobs/<job_id>/finished`     | completion, atomically       | `<wall ns>\\n`: every item has a result; retention counts from here |
| `jobs/<job_id>/pause`        | completion, atomically       | `<job_no> <wall ns>\\n`: a client paused the job (removed on resume); dispatch reads the job number at start |
| `jobs/<job_id>/priority`     | completion, atomically       | `<job_no> <priority>\\n`: a client changed the job's priority (over the record's `priority`); dispatch reads it with the record |
| `jobs/<job_id>/worker-seconds` | completion, atomically     | `<seconds>\\n`: the engine time its results took, from the workers' RESULTS (collector/completion/worker_time.py); rewritten at most each second and when it finishes |

A `<job_id>` matches JOB_ID, so it never names a path outside `jobs/`. A
directory without `job.json` is a job being created (the record is written
atomically) or not a job: readers skip it and look again later. A mark is
whole or absent: an empty `finished` would read as finished at time 0.

Chunk events in `chunks.log`, in order of their durability:

| record                                                         | meaning |
|----------------------------------------------------------------|---------|
| `{"e": "accept", "c", "first", "last", "ns"}` (+ `"ep", "life", "dl"`) | chunk c (lines first..last) may have items in the log from here on; written for every try the front sends on, with that try's landing: the broker life (`ep`), the front's life (`life`) and the writers' CLOCK_MONOTONIC deadline (`dl`, ns) for its records (absent in older journals) |
| `{"e": "commit", "c", "first", "last", "lines", "ids", "stored", "errors", "final"}` (+ `"parts"`, `"names"`, `"name_ix"`) | every item of chunk c is durable; `lines`/`ids` map line numbers to custom_ids (one entry per line); `stored` counts lines; `errors` are the rejected lines (`[line, custom_id, code, message]`); `parts`, only when some stored line has several parts: `[line, k, first]` per such line, its parts 1..k-1 at indexes first..first+k-2 (docs/completion.md, "Lines and parts"), with a fourth entry `n` when the line asked for n > 1 samples of each prompt (parts i*n..i*n+n-1 share prompt i; absent: 1, every part its own prompt, as in every older journal); a record without `parts` (every older journal) has one part per line; `names`, only when some stored line named its model by an alias (`[[models]] aliases`): the aliases the chunk's stored lines gave, and `name_ix`, one entry per entry of `lines`, 0 = the line gave its model's own name, k = `names[k - 1]` (absent: every stored line gave `names[0]`); the output's `model` repeats that name (ingest/model_aliases.py); a record without `names` (every older journal) gave the models' own names; `reused`, only for a `--reuse` job whose lines the reuse index answered: `[line, key, model, shape id, data file, offset, length]` per such line (counted in `lines`, `ids` and `stored`, never sent on: completion stores the result found, ingest/reuse_keys.py), and `rk`, `{"lines", "keys"}`: the request keys (32 hex digits each, concatenated) of its other deterministic lines, whose results completion indexes; `nofp`, `{model: why}`: the chunk's models that have no model fingerprint, whose lines never reuse (`status`'s `reuse_off`) |
| `{"e": "state", "state"}`                                      | the front moved the job to `validating` or `queued` |

Only a chunk's first commit counts (a retried chunk may be committed twice).
`ChunkProgress` folds these records: the front (ingest/jobs.py) and the
completion stage's view (collector/job_view.py) both fold through it, so they
agree on what a journal says.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import IngestError
from pipeline.core.job_states import JobState
from pipeline.store.durable import fsync_dir, write_whole
from pipeline.store.job_record import RECORD_NAME, encode_job_record, read_job_record
from pipeline.store.records import iter_records

JOBS_DIR = "jobs"
COUNTER_FILE = "next-job-no"
JOURNAL_FILE = "chunks.log"
CANCEL_MARK = "cancel"
FINISHED_MARK = "finished"
PAUSE_MARK = "pause"
PRIORITY_MARK = "priority"
WORKER_SECONDS = "worker-seconds"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z: "$" would allow a final newline


def check_job_id(job_id: str) -> str:
    """`job_id` if it may name a job (and so a directory under `jobs/`); IngestError if not."""
    if not JOB_ID.match(job_id):
        raise IngestError(
            f"job id {job_id!r} is not allowed: use 1-64 characters of letters, digits, "
            f"'.', '_' or '-', starting with a letter or digit"
        )
    return job_id


class JobFiles:
    """The paths and marks of every job under `<data_root>/jobs`; reads never write."""

    def __init__(self, data_root: Path) -> None:
        self.root = Path(data_root) / JOBS_DIR

    @property
    def counter_path(self) -> Path:
        return self.root / COUNTER_FILE

    def directory(self, job_id: str) -> Path:
        return self.root / check_job_id(job_id)

    def record_path(self, job_id: str) -> Path:
        return self.directory(job_id) / RECORD_NAME

    def journal_path(self, job_id: str) -> Path:
        return self.directory(job_id) / JOURNAL_FILE

    def cancel_path(self, job_id: str) -> Path:
        return self.directory(job_id) / CANCEL_MARK

    def finished_path(self, job_id: str) -> Path:
        return self.directory(job_id) / FINISHED_MARK

    def pause_path(self, job_id: str) -> Path:
        return self.directory(job_id) / PAUSE_MARK

    def priority_path(self, job_id: str) -> Path:
        return self.directory(job_id) / PRIORITY_MARK

    def worker_seconds_path(self, job_id: str) -> Path:
        return self.directory(job_id) / WORKER_SECONDS

    def read_worker_seconds(self, job_id: str) -> float:
        """The job's worker-seconds as last written (0.0 when none or unreadable)."""
        try:
            seconds = float(self.worker_seconds_path(job_id).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return 0.0
        return seconds if math.isfinite(seconds) and seconds > 0 else 0.0

    def write_worker_seconds(self, job_id: str, seconds: float) -> None:
        """Replace the job's worker-seconds atomically (OSError: not written)."""
        write_whole(self.worker_seconds_path(job_id), f"{seconds:.6f}\n".encode())

    def names(self) -> list[str]:
        """The ids of the job directories (sorted), with or without a record yet."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if e.is_dir() and JOB_ID.match(e.name))

    # ---- job.json --------------------------------------------------------------------
    def has_record(self, job_id: str) -> bool:
        return self.record_path(job_id).is_file()

    def read_record(self, job_id: str) -> dict[str, Any]:
        """The job's verified record (pipeline/store/job_record.py): JobRecordError when damaged,
        FileNotFoundError when there is none (a job being created, or none at all)."""
        return read_job_record(self.directory(job_id))

    def write_record(self, job_id: str, meta: dict[str, Any]) -> Path:
        """Create the job's directory and write its record, durably and atomically; OSError
        (a full disk) leaves no record. Returns the directory."""
        directory = self.directory(job_id)
        directory.mkdir(parents=True, exist_ok=True)
        write_whole(directory / RECORD_NAME, encode_job_record(meta), also_sync=(self.root,))
        return directory

    # ---- marks -----------------------------------------------------------------------
    def finished_ns(self, job_id: str) -> int | None:
        """When the job finished (wall ns), or None while it runs."""
        return _first_int(self.finished_path(job_id))

    def is_finished(self, job_id: str) -> bool:
        return self.finished_path(job_id).exists()

    def mark_finished(self, job_id: str, now_ns: int) -> None:
        """Note durably that every item of the job has a result (OSError: not noted)."""
        write_whole(self.finished_path(job_id), f"{now_ns}\n".encode())

    def is_cancelled(self, job_id: str) -> bool:
        return self.cancel_path(job_id).exists()

    def mark_cancelled(
        self, job_id: str, job_no: int, now_ns: int, at_deadline: bool = False, why: str = ""
    ) -> None:
        """Note durably that a client cancelled the job, `at_deadline`: because its deadline
        passed; `why`: words saying what else stopped it (a limit: pipeline/core/job_limits.py
        `Stop.mark_text`). OSError: not noted."""
        why = f" {JobState.EXPIRED}" if at_deadline else (f" {why}" if why else "")
        write_whole(self.cancel_path(job_id), f"{job_no} {now_ns}{why}\n".encode())

    def cancel_words(self, job_id: str) -> list[str]:
        """The words of the job's cancel mark after its job number and time ([] if none)."""
        try:
            return self.cancel_path(job_id).read_text().split()[2:]
        except (OSError, UnicodeDecodeError):
            return []

    def cancelled_at_deadline(self, job_id: str) -> bool:
        """Whether the job's cancel mark says it was cancelled at its deadline."""
        return self.cancel_words(job_id) == [JobState.EXPIRED]

    def is_paused(self, job_id: str) -> bool:
        return self.pause_path(job_id).exists()

    def mark_paused(self, job_id: str, job_no: int, now_ns: int) -> None:
        """Note durably that a client paused the job (OSError: not noted)."""
        write_whole(self.pause_path(job_id), f"{job_no} {now_ns}\n".encode())

    def clear_paused(self, job_id: str) -> None:
        """Note durably that a client resumed the job (OSError: not noted)."""
        path = self.pause_path(job_id)
        path.unlink(missing_ok=True)
        fsync_dir(path.parent)

    def paused_running(self) -> list[tuple[Path, int | None]]:
        """Every pause mark of a job not finished yet, with its job number (None: unreadable)."""
        marks = []
        for job_id in self.names():
            path = self.pause_path(job_id)
            if path.exists() and not self.is_finished(job_id):
                marks.append((path, _first_int(path)))
        return marks

    def priority(self, job_id: str) -> int | None:
        """The priority a client set on the running job, or None (the record's holds)."""
        try:
            return int(self.priority_path(job_id).read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def mark_priority(self, job_id: str, job_no: int, priority: int) -> None:
        """Note durably the job's new priority (OSError: not noted)."""
        write_whole(self.priority_path(job_id), f"{job_no} {priority}\n".encode())

    def cancelled_running(self) -> list[tuple[Path, int | None]]:
        """Every cancel mark of a job not finished yet, with the job number it holds (None
        when the mark is unreadable: the caller says so)."""
        marks = []
        for job_id in self.names():
            path = self.cancel_path(job_id)
            if path.exists() and not self.is_finished(job_id):
                marks.append((path, _first_int(path)))
        return marks


def _first_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---- chunks.log ----------------------------------------------------------------------
@dataclass(frozen=True)
class Landing:
    """Where a try of a chunk that the front sent on may still land: records of it may reach
    the log until `deadline_ns` (CLOCK_MONOTONIC; writers drop them after it), in broker life
    `epoch` (pipeline/process/stage.py broker_epoch), sent on by the front's life `life`."""

    epoch: int
    life: int
    deadline_ns: int


@dataclass
class ChunkEntry:
    """One chunk as the journal tells it."""

    first: int
    last: int
    accepted_ns: int  # its first accept: items of it may be in segments sealed after this
    committed: dict[str, Any] | None = None  # its first commit's stored, errors, final
    span: tuple[int, int] | None = None  # where that commit record lies in chunks.log
    landing: Landing | None = None  # its last try's, when recorded


class ChunkProgress:
    """What a job's journal says so far, folded one record at a time.

    `keep_errors=False` keeps only the count of rejected lines (the caller takes the lines
    from the commit records `apply` returns)."""

    def __init__(self, keep_errors: bool = True) -> None:
        self.keep_errors = keep_errors
        self.chunks: dict[int, ChunkEntry] = {}
        self.state = JobState.VALIDATING  # the front's state: validating or queued
        self.stored = 0
        self.rejected = 0
        self.reused = 0  # stored lines that took an earlier identical request's result
        self.final_chunk: int | None = None

    def apply(self, record: dict[str, Any], span: tuple[int, int] | None = None) -> bool:
        """Fold one record in; True when it is a chunk's first commit (the one that counts)."""
        kind = record.get("e")
        if kind == "accept":
            chunk = self.chunks.setdefault(
                record["c"], ChunkEntry(record["first"], record["last"], record["ns"])
            )
            if "dl" in record:
                chunk.landing = Landing(int(record["ep"]), int(record["life"]), int(record["dl"]))
        elif kind == "commit":
            chunk = self.chunks.setdefault(
                record["c"], ChunkEntry(record["first"], record["last"], 0)
            )
            if chunk.committed is not None:
                return False
            errors = record["errors"] if self.keep_errors else []
            chunk.committed = {
                "stored": record["stored"],
                "errors": errors,
                "final": record["final"],
            }
            chunk.span = span
            self.stored += int(record["stored"])
            self.rejected += len(record["errors"])
            self.reused += len(record.get("reused", ()))
            if record["final"]:
                c = record["c"]
                self.final_chunk = c if self.final_chunk is None else min(self.final_chunk, c)
            return True
        elif kind == "state":
            self.state = JobState(record["state"])
        return False

    @property
    def all_committed(self) -> bool:
        """True once the final chunk and every chunk before it are committed."""
        if self.final_chunk is None:
            return False
        return all(
            (s := self.chunks.get(c)) is not None and s.committed is not None
            for c in range(self.final_chunk + 1)
        )

    @property
    def total(self) -> int | None:
        """Lines in the job, once every chunk is committed (None while it is still submitted)."""
        return self.stored + self.rejected if self.all_committed else None

    @property
    def committed_chunks(self) -> int:
        return sum(1 for c in self.chunks.values() if c.committed is not None)

    def error_records(self) -> list[list[Any]]:
        """The rejected lines of every committed chunk, in chunk order (keep_errors only)."""
        return [
            e for c in sorted(self.chunks) if (r := self.chunks[c].committed) for e in r["errors"]
        ]


def journal_records(
    path: Path, offset: int = 0
) -> tuple[list[tuple[dict[str, Any], tuple[int, int]]], int]:
    """The whole records of a journal from byte `offset` on, each with its (start, end) in
    the file, and the offset just past the last one (a torn tail is left for later)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    found, start = [], 0
    for record, end in iter_records(data):
        found.append((record, (offset + start, offset + end)))
        start = end
    return found, offset + start


def journal_record_at(path: Path, span: tuple[int, int]) -> dict[str, Any]:
    """The record at `span` (from `journal_records`, or a ChunkEntry's)."""
    start, end = span
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    for record, _ in iter_records(data):
        return record
    raise IngestError(f"{path}: no whole record at bytes {start}..{end}; run `run.py check`")


def acknowledged_indexes(path: Path) -> np.ndarray:
    """Item indexes of every committed chunk of a journal that went into the input log (int64,
    sorted): line - 1 of each stored line, and the part-region indexes of its fan-out lines'
    other parts. Lines the reuse index answered (`reused`) are left out: they never reach the
    input log, and completion stores their results from this journal."""
    progress = ChunkProgress(keep_errors=False)
    records, _ = journal_records(path)
    found = []
    for record, span in records:
        if progress.apply(record, span):
            lines = np.asarray(record["lines"], np.int64)
            if record.get("reused"):
                lines = lines[~np.isin(lines, [r[0] for r in record["reused"]])]
            found.append(lines - 1)
            found.extend(part_indexes(record.get("parts", ())))
    return np.unique(np.concatenate(found)) if found else np.empty(0, np.int64)


def part_indexes(parts) -> list[np.ndarray]:
    """The part-region indexes of `[line, k, first(, n)]` fan-out entries (parts 1..k-1 each)."""
    return [np.arange(f[2], f[2] + f[1] - 1, dtype=np.int64) for f in parts]
