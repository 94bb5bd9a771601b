"""Batch records on disk and the OpenAI Batch object.

| path (under `<data_dir>/api/`)      | what                                                |
|-------------------------------------|-----------------------------------------------------|
| `batches/<batch_id>/batch.json`     | the record (api/batch_record.py): the create request, its owner, status, timestamps, counts, the job's token totals (`usage`), errors; replaced whole, atomically, by the driver (api-0) only |
| `batches/<batch_id>/cancel`         | a cancel request (its time), written by whichever process took it |
| `batches/<batch_id>/pause`          | a pause request (its time; removed by a resume), written by whichever process took it; the driver pauses or resumes the job to match |
| `batches/<batch_id>/output.jsonl`   | result lines, appended by the driver as completion delivers them |
| `batches/<batch_id>/error.jsonl`    | error lines, likewise                                |
| `batches/<batch_id>/input.jsonl`    | the input with lines kept out of the job blanked (a batch that accepts partial input with lines for another endpoint) |

A batch is created by renaming a fully written, fsynced directory into
place: the rename is the commit point, and it fails if the directory exists.
With an `Idempotency-Key` the batch id is a digest of (owner, key), so a
retried create, even one racing the first or following a crash, finds the
batch the first one made and returns it. The batch id is also the id of
the broker job that carries its items (`run.py status <batch_id>` works).

After creation one writer owns the record (the driver in api-0); request
handlers only read it and drop `cancel` and `pause` marks, so several api processes
never race on a record.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from api.batch_record import BatchRecord
from pipeline.core.job_states import BatchStatus
from pipeline.store.durable import fsync_dir, write_whole

RECORD = "batch.json"
CANCEL = "cancel"
PAUSE = "pause"
OUTPUT = "output.jsonl"
ERRORS = "error.jsonl"
INPUT_COPY = "input.jsonl"  # the input with the lines kept out of the job blanked
ACCEPT_PARTIAL_KEY = "fabric_accept_partial"  # metadata extension: keep the good lines
PRIORITY_KEY = "fabric_priority"  # metadata extension: the job's priority, an integer
PAUSED_KEY = "fabric_paused"  # metadata the Batch object shows while the batch is paused


BATCH_ID = re.compile(r"batch_[A-Za-z0-9_-]{1,58}\Z")  # what the two functions below make


def idempotent_batch_id(owner: str, key: str) -> str:
    return "batch_" + hashlib.sha256(f"{owner}\0{key}".encode()).hexdigest()[:24]


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BatchStore:
    """The batches of one data dir (`<data_dir>/api/batches`)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "batches"
        new = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        if new:
            fsync_dir(self.dir.parent)

    def path(self, batch_id: str, name: str = "") -> Path:
        return self.dir / batch_id / name if name else self.dir / batch_id

    def sweep(self) -> None:
        """Remove creates a crash left before their rename (never committed)."""
        for path in self.dir.glob(".new-*"):
            shutil.rmtree(path, ignore_errors=True)

    def create(self, record: BatchRecord) -> tuple[BatchRecord, bool]:
        """Commit a new batch record; (the record, True), or (the existing one, False) when a
        batch with this id exists (a retried idempotent create)."""
        batch_id = record.id
        final = self.path(batch_id)
        if final.exists():
            return self.get(batch_id), False
        tmp = self.dir / f".new-{secrets.token_hex(8)}"
        tmp.mkdir()
        write_whole(tmp / RECORD, record.to_json())
        try:
            os.rename(tmp, final)
        except OSError:  # exists now: a create racing ours won
            shutil.rmtree(tmp, ignore_errors=True)
            existing = self.get(batch_id)
            if existing is None:
                raise
            return existing, False
        fsync_dir(self.dir)
        return record, True

    def get(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        if not BATCH_ID.match(batch_id):  # never a path of its own ("..", "/", a NUL byte)
            return None
        try:
            record = BatchRecord.from_json(self.path(batch_id, RECORD).read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            return None
        if owner is not None and record.owner != owner:
            return None
        return record

    def put(self, record: BatchRecord) -> None:
        """Replace a record (the driver only)."""
        write_whole(self.path(record.id, RECORD), record.to_json())

    def all(self, skip: set[str] | frozenset = frozenset()) -> list[BatchRecord]:
        """Every batch record but those in `skip`."""
        records = []
        for path in self.dir.iterdir():
            if path.name.startswith("batch_") and path.name not in skip:
                record = self.get(path.name)
                if record is not None:
                    records.append(record)
        return records

    def request_cancel(self, batch_id: str) -> None:
        path = self.path(batch_id, CANCEL)
        if not path.exists():
            write_whole(path, str(int(time.time())).encode())

    def request_pause(self, batch_id: str, paused: bool) -> None:
        """Ask for the batch paused (or resumed): the driver makes its job match."""
        path = self.path(batch_id, PAUSE)
        if paused and not path.exists():
            write_whole(path, str(int(time.time())).encode())
        elif not paused and path.exists():
            path.unlink(missing_ok=True)
            fsync_dir(path.parent)

    def pause_requested(self, batch_id: str) -> bool:
        return self.path(batch_id, PAUSE).exists()

    def cancel_requested(self, batch_id: str) -> int | None:
        """When a cancel was asked for (unix seconds), or None."""
        try:
            return int(self.path(batch_id, CANCEL).read_text())
        except (FileNotFoundError, ValueError):
            return None


def to_openai(
    record: BatchRecord, cancel_at: int | None = None, paused: bool = False
) -> dict[str, Any]:
    """OpenAI's Batch object of a record. `cancel_at`: a cancel asked for that the driver has
    not taken up yet (the batch shows `cancelling` at once, as OpenAI's does). `paused`: a
    pause is asked for (the metadata says `fabric_paused: "true"` until the batch ends)."""
    status = record.status
    stamps = record.stamps()
    if cancel_at is not None and not status.terminal and status != BatchStatus.CANCELLING:
        status = BatchStatus.CANCELLING
        stamps["cancelling_at"] = stamps["cancelling_at"] or cancel_at
    errors = record.errors
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model,
        "errors": None if errors is None else {"object": "list", "data": errors},
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": str(status),
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        **stamps,
        "expires_at": record.expires_at,
        "request_counts": dict(record.request_counts),
        "usage": batch_usage(record.usage),
        "metadata": {**(record.metadata or {}), PAUSED_KEY: "true"}
        if paused and not status.terminal
        else record.metadata,
    }


def batch_usage(totals: dict[str, int] | None) -> dict[str, Any]:
    """OpenAI's Batch.usage from the job's token totals (the `usage` of completion's JOB_INFO:
    prompt_tokens, completion_tokens, total_tokens), as the driver last read them; zero before
    any is counted and for a batch that never ran a job. The broker counts neither cached
    prompt tokens nor reasoning tokens apart: their details are 0."""
    totals = totals or {}
    prompt = int(totals.get("prompt_tokens", 0))
    generated = int(totals.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(totals.get("total_tokens", prompt + generated)),
    }
