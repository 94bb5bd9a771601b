"""A batch's output and error files, and their File records (for the driver, api/batch_driver.py).

| what | when |
|------|------|
| `register` | the File record of `output.jsonl` or `error.jsonl` (again: it is the same, its id fixed by the batch) |
| `keep_out` | lines of another endpoint (`fabric_accept_partial`): their error lines, and a copy of the input with them blank |
| `expire_unsent` | a batch past its deadline before its job existed: every line a `batch_expired` error line |

Every write is safe to repeat after a kill: error lines are keyed by
custom_id (collector/delivery/result_file.py), a rewrite is whole and atomic.
Each is durable before the record that names it: the input copy is fsynced,
and its directory, before the driver's record points the job at it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from api.batch_record import BatchRecord
from api.batch_store import ERRORS, INPUT_COPY, OUTPUT, BatchStore
from api.file_store import PURPOSE_OUTPUT, FileRecord, FileStore, output_file_id
from collector.delivery.lines import line_key
from collector.delivery.result_file import ResultFile
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.store.durable import fsync_dir

EXPIRED_CODE = ItemErrorCode.BATCH_EXPIRED  # completion gives an expired job's items the same
EXPIRED_MESSAGE = "the batch expired before this request was run"


class BatchFiles:
    """The output and error files of the batches of one api root."""

    def __init__(self, files: FileStore, batches: BatchStore) -> None:
        self.files = files
        self.batches = batches

    def has_errors(self, batch_id: str) -> bool:
        path = self.batches.path(batch_id, ERRORS)
        return path.exists() and path.stat().st_size > 0

    def register_errors(self, record: BatchRecord) -> None:
        if self.has_errors(record.id):
            record.error_file_id = output_file_id(record.id, "error")
            self.register(record, "error")

    def register(self, record: BatchRecord, which: str) -> None:
        """Write the File record of the batch's output ("output") or error ("error") file."""
        batch_id = record.id
        path = self.batches.path(batch_id, OUTPUT if which == "output" else ERRORS)
        if not path.exists():
            ResultFile.open(path).close()  # created empty, and its directory synced
        self.files.put(
            FileRecord(
                id=output_file_id(batch_id, which),
                owner=record.owner,
                bytes=path.stat().st_size,
                created_at=record.in_progress_at or record.created_at,
                filename=f"{batch_id}_{which}.jsonl",
                purpose=PURPOSE_OUTPUT,
                path=str(path.relative_to(self.files.root)),
                batch_id=batch_id,
            )
        )

    def keep_out(
        self, batch_id: str, path: Path, drop: dict[int, str | None], errors: list
    ) -> Path:
        """A copy of the input with lines `drop` blank (numbers kept); their error lines are
        written to the batch's error file first."""
        messages = {e["line"]: e["message"] for e in errors}
        self._error_lines(batch_id, ((n, c, "invalid_url", messages[n]) for n, c in drop.items()))
        copy = self.batches.path(batch_id, INPUT_COPY)
        with open(path, "rb") as src, open(copy, "wb") as dst:
            for number, line in enumerate(src, 1):
                dst.write(b"\n" if number in drop else line)
            dst.flush()
            os.fsync(dst.fileno())  # the record names it next, and the job's lines come from it
        fsync_dir(copy.parent)
        return copy

    def expire_unsent(self, record: BatchRecord) -> None:
        """The deadline passed before the job was submitted: every line is batch_expired."""
        source = self.files.get(record.input_file_id)
        if source is not None:
            lines = [
                (number, custom_id, EXPIRED_CODE, EXPIRED_MESSAGE)
                for number, custom_id in _custom_ids(self.files.content_path(source))
            ]
            self._error_lines(record.id, lines)
            record.request_counts = {"total": len(lines), "completed": 0, "failed": len(lines)}
        self.register_errors(record)

    def _error_lines(self, batch_id: str, lines) -> None:
        """Append (line number, custom_id, code, message) error lines, synced."""
        with ResultFile.open(self.batches.path(batch_id, ERRORS)) as err:
            out, keys = [], []
            for number, custom_id, code, message in lines:
                out.append(_error_line(batch_id, number, custom_id, code, message))
                keys.append(line_key(custom_id, f"{batch_id}-line-{number}"))
            err.write(out, keys)
            err.sync()


def _error_line(batch_id: str, number: int, custom_id, code: str, message: str) -> bytes:
    line: dict[str, Any] = {
        "id": f"{batch_id}-line-{number}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _custom_ids(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, custom_id or None) of every non-blank line."""
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    custom_id = orjson.loads(line).get("custom_id")
                except (orjson.JSONDecodeError, AttributeError):
                    custom_id = None
                yield number, custom_id if isinstance(custom_id, str) else None
