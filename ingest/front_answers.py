"""What the front answers producers, besides refusals: CATALOG, JOB_INFO and CHUNK_ACK.

| request      | answer    | built by    |
|--------------|-----------|-------------|
| HELLO        | CATALOG   | `catalog`   |
| JOB_STATUS   | JOB_INFO  | `job_info`  |
| SUBMIT_CHUNK | CHUNK_ACK | `chunk_ack` |
"""

from __future__ import annotations

from typing import Any

import numpy as np

from config.stage_settings import Catalogued
from ingest.catalog import ModelCatalog
from ingest.error_wire import errors_to_wire
from ingest.jobs import Job, JobRegistry
from ingest.line_errors import LineError
from pipeline.core.errors import IngestError


def catalog(settings: Catalogued, models: ModelCatalog) -> dict[str, Any]:
    """CATALOG's meta: served models, lanes, chunk size and the message size limit."""
    return {
        "models": [
            {
                "name": m.name,
                "engine": m.engine,
                "tokenizer": m.tokenizer,
                "max_tokens": m.max_tokens,
                "endpoints": list(m.endpoints),
                "aliases": list(m.aliases),
                # as resolved here (ingest.catalog), so the producer refuses the same ids
                "vocab_size": models.models[m.name].vocab_size or 0,
            }
            for m in settings.models
        ],
        "lanes": list(settings.broker.lanes),
        "chunk_items": settings.ingest.chunk_items,
        "max_message_bytes": settings.ingest.max_message_bytes,
    }


def job_info(registry: JobRegistry, job_id: str) -> dict[str, Any]:
    """JOB_INFO's meta: a job's state, counts, chunk size and committed chunks."""
    try:
        job = registry.get(job_id)
    except IngestError as exc:
        return {"job": job_id, "exists": False, "reason": str(exc)}
    if job is None:
        return {"job": job_id, "exists": False}
    committed = sorted(c for c, s in job.chunks.items() if s.committed is not None)
    return {
        **job.summary(),
        "job": job_id,
        "exists": True,
        "chunk_lines": job.chunk_lines,
        "committed": committed,
    }


def chunk_ack(
    job: Job, number: int, duplicate: bool = False
) -> tuple[dict[str, Any], int, dict[str, np.ndarray]]:
    """CHUNK_ACK's meta, flags and arrays: the rejected lines go as compact arrays, so the
    answer fits its limits however many lines the chunk had rejected."""
    record = job.chunks[number].committed
    meta = {
        "job": job.job_id,
        "chunk": number,
        "stored": record["stored"],
        "rejected": len(record["errors"]),
        "duplicate": duplicate,
        "state": job.state,
    }
    errors = (LineError(int(a), b, str(c), str(d)) for a, b, c, d in record["errors"])
    return meta, 0, errors_to_wire(errors)


def chunk_error(meta: dict[str, Any], reason: str) -> dict[str, Any]:
    """A CHUNK_ERROR's meta for the chunk a request's `meta` names (as well as it can)."""
    chunk = meta.get("chunk")
    number = chunk if isinstance(chunk, int) and chunk >= 0 else 0
    return {"job": str(meta.get("job", "")), "chunk": number, "reason": reason}
