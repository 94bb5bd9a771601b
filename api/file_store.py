"""Files on disk: an id exists only once its content and its record are durable.

| path (under `<data_dir>/api/`)   | what                                                     |
|----------------------------------|----------------------------------------------------------|
| `files/<file_id>.json`           | the record (OpenAI's File object, its owner, where the bytes are); written whole, atomically: the commit point of an upload |
| `files/<file_id>.data`           | an uploaded file's bytes, fsynced (and its directory) before the record is written |
| `files/.upload-<random>`         | an upload still arriving; removed if it fails, swept at start-up |
| `batches/<batch_id>/output.jsonl`, `error.jsonl` | a batch's output and error files (api/batch_store.py); their records point there |

Records are read from disk on every request (several `api` processes may
serve one data dir); only uploads and deletes write them, each in one atomic
step, so a reader never sees half a record. A crash during an upload leaves
only a `.upload-*` file, which no id names.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from pipeline.store.durable import fsync_dir, write_whole

PURPOSE_INPUT = "batch"
PURPOSE_OUTPUT = "batch_output"
UPLOAD_PREFIX = ".upload-"


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    path: str  # relative to the api root
    expires_at: int | None = None
    batch_id: str | None = None  # the batch an output or error file belongs to

    def to_openai(self, size: int | None = None) -> dict[str, Any]:
        """OpenAI's File object (`size`: the bytes now, for a file still growing)."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes if size is None else size,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


FILE_ID = re.compile(r"file-[A-Za-z0-9_-]{1,59}\Z")  # what new_file_id and output_file_id make


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def output_file_id(batch_id: str, which: str) -> str:
    """The id of a batch's output ("output") or error ("error") file: fixed by the batch, so a
    driver that crashed while registering it registers the same id again."""
    return "file-" + hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()[:24]


class FileStore:
    """The files of one data dir (`<data_dir>/api`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files = self.root / "files"
        new = not self.files.exists()
        self.files.mkdir(parents=True, exist_ok=True)
        if new:
            fsync_dir(self.root)

    def sweep(self) -> int:
        """Remove uploads a crash left half-way and bytes no record names; return how many."""
        removed = 0
        names = {p.name for p in self.files.iterdir()}
        for name in names:
            orphan = name.endswith(".data") and name.removesuffix(".data") + ".json" not in names
            if name.startswith(UPLOAD_PREFIX) or orphan:
                (self.files / name).unlink(missing_ok=True)
                removed += 1
        if removed:
            fsync_dir(self.files)
        return removed

    # ---- uploads ---------------------------------------------------------------------------
    def upload_path(self) -> Path:
        return self.files / f"{UPLOAD_PREFIX}{secrets.token_hex(8)}"

    def commit_upload(
        self, tmp: Path, owner: str, filename: str, size: int, expires_after_s: float
    ) -> FileRecord:
        """Make a complete, fsynced upload at `tmp` a file with an id: bytes renamed into place,
        the directory synced, then the record written (the commit point)."""
        file_id = new_file_id()
        data = self.files / f"{file_id}.data"
        os.replace(tmp, data)
        fsync_dir(self.files)
        now = int(time.time())
        record = FileRecord(
            id=file_id,
            owner=owner,
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=PURPOSE_INPUT,
            path=f"files/{file_id}.data",
            expires_at=now + int(expires_after_s),
        )
        self.put(record)
        return record

    # ---- records ---------------------------------------------------------------------------
    def put(self, record: FileRecord) -> None:
        write_whole(self.files / f"{record.id}.json", orjson.dumps(asdict(record)))

    def get(self, file_id: str, owner: str | None = None) -> FileRecord | None:
        """The record of `file_id` (of `owner`, when given), or None."""
        if not FILE_ID.match(file_id):  # never a path of its own ("..", "/", a NUL byte)
            return None
        try:
            record = FileRecord(**orjson.loads((self.files / f"{file_id}.json").read_bytes()))
        except FileNotFoundError:
            return None
        if owner is not None and record.owner != owner:
            return None
        return record

    def all(self) -> list[FileRecord]:
        records = []
        for path in self.files.glob("file-*.json"):
            try:
                records.append(FileRecord(**orjson.loads(path.read_bytes())))
            except FileNotFoundError:
                continue  # deleted meanwhile
        return records

    def content_path(self, record: FileRecord) -> Path:
        return self.root / record.path

    def delete(self, record: FileRecord) -> None:
        """The record first (the id is gone), then an uploaded file's bytes."""
        (self.files / f"{record.id}.json").unlink(missing_ok=True)
        fsync_dir(self.files)
        if record.purpose == PURPOSE_INPUT:
            self.content_path(record).unlink(missing_ok=True)

    def expire(self, now: float, in_use: set[str]) -> list[str]:
        """Delete input files past their expires_at that no unfinished batch reads."""
        gone = []
        for record in self.all():
            due = record.expires_at is not None and record.expires_at <= now
            if due and record.purpose == PURPOSE_INPUT and record.id not in in_use:
                self.delete(record)
                gone.append(record.id)
        return gone
