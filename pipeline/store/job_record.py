"""The job record, `jobs/<job_id>/job.json`: its fields, its checksum and its one reader.

| field        | meaning                                                         | since |
|--------------|-----------------------------------------------------------------|-------|
| `job_id`     | the job's id; must equal the directory's name (if absent: it)   | 1     |
| `job_no`     | the job's number: its items' seqs are `pipeline.core.item_seq.seq_of(job_no, index)` | 1 |
| `created_ns` | wall-clock creation time                                        | 1     |
| `chunk_lines`| lines per chunk                                                 | 1     |
| `deliver`    | where results go (ingest.jobs.parse_deliver); "file" if absent  | 1     |
| `source`     | the input file's absolute path on the producer's host, if sent  | 2     |
| `deadline`   | when the job should be done (wall seconds since the epoch), if it has one: dispatch serves earlier deadlines first (docs/dispatch.md); absent: no deadline | 2 |
| `limits`     | the job's caps (pipeline/core/job_limits.py: `max_error_rate`, `min_sample`, `max_errors`, `max_tokens`), if it has any: completion stops the job when it passes one | 2 |
| `v`          | record version: absent (1) or 2                                 | 2     |
| `crc`        | version 2: CRC-32 of the record without `crc`, keys sorted, as compact JSON | 2 |

Optional fields (`source`, `deadline`, `limits`) are additive: a record without them
is read as before (no source, no deadline), so they need no new version.
A record is written once, atomically, by the front (ingest/jobs.py, through
pipeline/store/job_files.py, which knows where it lies). Version 1 records
(no `v`, no `crc`) are still read; they cannot be checked beyond their
fields. A record whose checksum fails, whose `job_id` is not its
directory's name, or whose fields are missing is refused with
JobRecordError: a job number read from a damaged record could deliver one
job's results under another job's custom_ids, so nothing of the job is
served until an operator looks (`run.py check` names it).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import orjson

from pipeline.core.errors import IngestError
from pipeline.store.model_names import NAME_RULE, name_problem

RECORD_NAME = "job.json"
RECORD_VERSION = 2
REQUIRED = ("job_no", "created_ns")


class JobRecordError(IngestError):
    """A job record that cannot be trusted (damaged, mismatched or unreadable)."""


def _crc(meta: dict[str, Any]) -> int:
    body = {k: v for k, v in meta.items() if k != "crc"}
    return zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS))


def encode_job_record(meta: dict[str, Any]) -> bytes:
    """The bytes of a version 2 record holding `meta`, with its checksum."""
    record = {**meta, "v": RECORD_VERSION}
    record["crc"] = _crc(record)
    return orjson.dumps(record)


def record_deadline(meta: dict[str, Any]) -> float | None:
    """The job's deadline (wall seconds) from its verified record; None when it has none."""
    deadline = meta.get("deadline")
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        return None
    return float(deadline) if math.isfinite(deadline) and deadline > 0 else None


PRIORITY_LIMIT = 1_000_000  # a job's priority is an integer from -this to this (higher first)


def record_priority(meta: dict[str, Any]) -> int:
    """The job's priority at submit from its verified record (higher first); 0 when it has
    none (every older record)."""
    priority = meta.get("priority")
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else 0


def read_job_record(directory: Path) -> dict[str, Any]:
    """The verified record of the job in `directory`; JobRecordError naming what is wrong.

    FileNotFoundError when there is no record (a job being created, or not a job).
    """
    path = Path(directory) / RECORD_NAME
    data = path.read_bytes()
    try:
        meta = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise JobRecordError(
            f"{path}: not readable JSON ({exc}); the job is refused: restore the record or "
            f"remove the job"
        ) from None
    if not isinstance(meta, dict) or any(k not in meta for k in REQUIRED):
        raise JobRecordError(
            f"{path}: a job record needs the fields {', '.join(REQUIRED)}; the job is refused"
        )
    version = meta.get("v", 1)
    if version not in (1, RECORD_VERSION):
        raise JobRecordError(
            f"{path}: record version {version!r} is not one this broker reads (1 or "
            f"{RECORD_VERSION})"
        )
    if version == RECORD_VERSION and meta.get("crc") != _crc(meta):
        raise JobRecordError(
            f"{path}: checksum mismatch (the record is damaged); the job is refused so that "
            f"no results are delivered under the wrong job: restore the record or remove the job"
        )
    meta.setdefault("job_id", path.parent.name)  # a version 1 record may lack it
    if meta["job_id"] != path.parent.name:
        raise JobRecordError(
            f"{path}: names job {meta['job_id']!r} but lies in directory "
            f"{path.parent.name!r}; the job is refused"
        )
    if not isinstance(meta["job_no"], int) or meta["job_no"] < 1:
        raise JobRecordError(f"{path}: job_no {meta['job_no']!r} is not a positive integer")
    return meta


# Where a job's results go (its record's `deliver`): results clients, or a vector store.
DELIVER_FILE = "file"
DELIVER_VECTORS = "vectors"


def parse_deliver(text: str) -> str:
    """Where a job's results go: "file" (results clients), "vectors" (the vector store named
    after each result's model) or "vectors:STORE". Returns the canonical form."""
    kind, _, store = str(text).partition(":")
    if kind == DELIVER_FILE and not store:
        return DELIVER_FILE
    if kind == DELIVER_VECTORS:
        if not store:
            return DELIVER_VECTORS
        if name_problem(store) is None:
            return f"{DELIVER_VECTORS}:{store}"
    raise IngestError(
        f"deliver {text!r} is not understood: use 'file', 'vectors' (a store named after "
        f"the model) or 'vectors:STORE' (a store name of {NAME_RULE})"
    )
