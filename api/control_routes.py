"""`POST /v1/batches/{id}/pause` and `/resume`: extensions of the OpenAI Batch API.

OpenAI has no pause; these are this broker's (docs/http-api.md). A request
drops or removes the batch's `pause` mark (api/batch_store.py) and answers
the Batch object at once; the driver (api/batch_driver.py) makes the job
match on its next pass (collector/completion/control.py: its queued items
wait, items in flight finish). The status stays `in_progress` and the
metadata says `"fabric_paused": "true"`; the batch's `expires_at` keeps
running while it is paused. A batch that has ended, or is being cancelled,
answers 409 `batch_not_pausable`; one in `validating` is paused as soon as
its job exists. The priority of a batch is its metadata `fabric_priority`
(an integer), checked at create (`priority_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from api.batch_store import PRIORITY_KEY, BatchStore, to_openai
from api.errors import ApiError, invalid, not_found
from pipeline.core.job_states import BatchStatus
from pipeline.store.job_record import PRIORITY_LIMIT


def priority_of(metadata: dict[str, str] | None) -> int:
    """The job priority a create's metadata asks for (`fabric_priority`; default 0); a 400
    naming the value when it is not an integer in range."""
    text = (metadata or {}).get(PRIORITY_KEY)
    if text is None:
        return 0
    try:
        priority = int(text)
    except ValueError:
        priority = PRIORITY_LIMIT + 1
    if abs(priority) > PRIORITY_LIMIT:
        raise invalid(
            f"metadata {PRIORITY_KEY} {text!r} is not an integer from -{PRIORITY_LIMIT} to "
            f'{PRIORITY_LIMIT}: send one as a string, e.g. "5" (higher first; default 0)',
            param="metadata",
        )
    return priority


def add_control_routes(
    app: FastAPI, batches: BatchStore, owner_of: Callable[[Request], str]
) -> None:
    def control(request: Request, batch_id: str, paused: bool) -> dict[str, Any]:
        record = batches.get(batch_id, owner_of(request))
        if record is None:
            raise not_found("batch", batch_id)
        cancel_at = batches.cancel_requested(batch_id)
        if record.ended or record.status == BatchStatus.CANCELLING or cancel_at is not None:
            raise ApiError(
                409,
                f"Cannot {'pause' if paused else 'resume'} a batch with status "
                f"'{record.status}'{' (cancel requested)' if cancel_at is not None else ''}.",
                code="batch_not_pausable",
            )
        batches.request_pause(batch_id, paused)
        return to_openai(record, cancel_at, paused)

    @app.post("/v1/batches/{batch_id}/pause")
    def pause_batch(request: Request, batch_id: str) -> dict:
        return control(request, batch_id, True)

    @app.post("/v1/batches/{batch_id}/resume")
    def resume_batch(request: Request, batch_id: str) -> dict:
        return control(request, batch_id, False)
