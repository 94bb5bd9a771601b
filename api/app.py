"""The FastAPI application: OpenAI's /v1/files and /v1/batches, over the file and batch stores,
and /v1/models (api/models_route.py).

Every route names its owner from the bearer key (api/keys.py) and sees only
that owner's objects: another owner's id answers 404, like an unknown one.
Errors carry OpenAI's body (api/errors.py), including FastAPI's own (a bad
query value, an unknown route).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from api.batch_limits import check_limits
from api.batch_record import BatchRecord
from api.batch_reuse import reuse_of
from api.batch_store import BatchStore, idempotent_batch_id, new_batch_id, to_openai
from api.control_routes import add_control_routes, priority_of
from api.dispatch_view import (
    STRICT_KEY,
    DispatchView,
    JobNumbers,
    add_demand_route,
    promised,
    strict_deadline,
)
from api.errors import ApiError, invalid, not_found
from api.file_store import PURPOSE_INPUT, FileStore
from api.keys import KeyRing
from api.models_route import add_models_routes
from api.route_stats import CountRequests, RouteStats
from api.upload import UploadParser, receive_upload
from collector.webhook_outbox import Outbox
from collector.webhooks import Webhooks, event_id
from config.stage_settings import ApiStageSettings
from pipeline.transport.security import client_curve

READ_BLOCK = 1 << 20
PARTIAL_HEADER = "X-Fabric-Partial"  # "true" on the content of a batch's file still growing
WINDOW = re.compile(r"(\d{1,9})([smhd])\Z")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_METADATA_KEYS = 16


def parse_window(text: Any) -> int:
    """Seconds of a completion_window: "24h" (OpenAI's one value), or as an extension any
    "<N>s", "<N>m", "<N>h", "<N>d" of at least one second."""
    match = WINDOW.match(text) if isinstance(text, str) else None
    if match is None or int(match[1]) == 0:
        raise invalid(
            f"completion_window {text!r} is not understood: use '24h' (or, on this server, "
            "a duration such as '30s', '10m', '2h', '7d')",
            param="completion_window",
            code="invalid_completion_window",
        )
    return int(match[1]) * UNIT_S[match[2]]


def make_app(
    settings: ApiStageSettings,
    root: Path,
    endpoints: tuple[str, ...],
    dispatch_address: str | None = None,
) -> FastAPI:
    """The app over `<data_dir>/api` (`root`); `endpoints`: the urls the broker's models serve;
    `dispatch_address`: where dispatch answers status (the demand, deadline projections;
    None: nowhere, those answer 503 or are left out). `app.state.route_stats` counts the
    requests (RouteStats)."""
    files = FileStore(root)
    batches = BatchStore(root)
    keys = KeyRing(settings.api.keys_file)
    webhooks, outbox = Webhooks(settings.api), Outbox(root)
    app = FastAPI(title="Inference Fabric: OpenAI Batch API", docs_url=None, redoc_url=None)
    app.state.route_stats = RouteStats()
    app.add_middleware(CountRequests, stats=app.state.route_stats)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return invalid(
            f"{where or 'request'}: {first.get('msg', 'invalid')}", param=where
        ).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, type=kind).response()

    def owner_of(request: Request) -> str:
        return keys.owner(request.headers.get("authorization"))

    add_models_routes(app, settings, owner_of)  # GET /v1/models, /v1/models/{id}
    add_control_routes(app, batches, owner_of)  # POST /v1/batches/{id}/pause, /resume
    dispatch = DispatchView(dispatch_address, client_curve(settings.security))
    add_demand_route(app, dispatch, owner_of)  # GET /v1/fabric/demand (an extension)
    app.state.dispatch_view = dispatch  # closed with the stage
    job_numbers = JobNumbers(root.parent)  # a batch's job is named after it

    # ---- files -----------------------------------------------------------------------------
    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        owner = owner_of(request)
        tmp = files.upload_path()
        parser = UploadParser(
            request.headers.get("content-type"), tmp, settings.api.max_upload_bytes
        )
        try:
            await receive_upload(request.stream(), parser)
            purpose = parser.fields.get("purpose", b"").decode("utf-8", "replace")
            if purpose != PURPOSE_INPUT:
                raise invalid(
                    f"purpose {purpose!r} is not supported: this server takes batch input "
                    "files, purpose 'batch'",
                    param="purpose",
                )
            await run_in_threadpool(parser.sync)
            parser.close()
            record = await run_in_threadpool(
                files.commit_upload,
                tmp,
                owner,
                parser.filename or "upload.jsonl",
                parser.size,
                settings.api.input_file_expiry_s,
            )
        except ClientDisconnect:
            parser.discard()
            raise invalid("The upload was cut off before its end; upload the file again") from None
        except BaseException:
            parser.discard()
            raise
        return JSONResponse(record.to_openai())

    @app.get("/v1/files")
    def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = 10000,
        after: str | None = None,
        order: str = "desc",
    ) -> dict:
        owner = owner_of(request)
        if not 1 <= limit <= 10000:
            raise invalid(f"limit {limit} must be between 1 and 10000", param="limit")
        if order not in ("asc", "desc"):
            raise invalid(f"order {order!r} must be 'asc' or 'desc'", param="order")
        mine = [r for r in files.all() if r.owner == owner]
        if purpose:
            mine = [r for r in mine if r.purpose == purpose]
        mine.sort(key=lambda r: (r.created_at, r.id), reverse=order == "desc")
        return _page([_file_object(files, r) for r in mine], after, limit)

    @app.get("/v1/files/{file_id}")
    def get_file(request: Request, file_id: str) -> dict:
        record = files.get(file_id, owner_of(request))
        if record is None:
            raise not_found("file", file_id)
        return _file_object(files, record)

    @app.delete("/v1/files/{file_id}")
    def delete_file(request: Request, file_id: str) -> dict:
        record = files.get(file_id, owner_of(request))
        if record is None:
            raise not_found("file", file_id)
        files.delete(record)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.get("/v1/files/{file_id}/content")
    def file_content(request: Request, file_id: str) -> StreamingResponse:
        record = files.get(file_id, owner_of(request))
        if record is None:
            raise not_found("file", file_id)
        partial = False
        if record.batch_id is not None:
            batch = batches.get(record.batch_id)
            partial = batch is None or not batch.ended
        try:
            handle = open(files.content_path(record), "rb")  # noqa: SIM115 (closed by _stream)
        except FileNotFoundError:
            raise not_found("file", file_id) from None
        size = _whole_lines(handle) if partial else os.fstat(handle.fileno()).st_size
        headers = {"Content-Length": str(size), PARTIAL_HEADER: "true" if partial else "false"}
        return StreamingResponse(
            _stream(handle, size), media_type="application/octet-stream", headers=headers
        )

    # ---- batches ---------------------------------------------------------------------------
    def batch_object(record: BatchRecord) -> dict[str, Any]:
        """OpenAI's Batch, with a cancel or pause asked for and not taken up yet, and (an
        extension) `fabric_webhook`: its end event's delivery."""
        out = to_openai(
            record, batches.cancel_requested(record.id), batches.pause_requested(record.id)
        )
        delivery = outbox.find(event_id(record.id)) if record.ended else None
        if delivery is not None:
            out["fabric_webhook"] = delivery.summary()
        if not record.ended:  # its deadline's live projection (api/dispatch_view.py)
            out = dispatch.with_projection(out, job_numbers.of(record.id))
        return out

    @app.post("/v1/batches")
    def create_batch(request: Request, body: dict[str, Any]) -> dict:
        owner = owner_of(request)
        input_file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(input_file_id, str):
            raise invalid("input_file_id is required", param="input_file_id")
        if endpoint not in endpoints:
            raise invalid(
                f"endpoint {endpoint!r} is not served here: use one of {', '.join(endpoints)}",
                param="endpoint",
                code="invalid_endpoint",
            )
        window = body.get("completion_window", "24h")
        window_s = parse_window(window)
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise invalid(
                f"metadata must be an object of at most {MAX_METADATA_KEYS} string values",
                param="metadata",
            )
        priority_of(metadata)  # a 400 now for a fabric_priority that is not an integer
        reuse_of(metadata)  # likewise for a fabric_reuse that is not "true" or "false"
        problem = webhooks.batch_url_problem(owner, metadata)
        if problem:
            raise invalid(problem, param="metadata")
        check_limits(metadata)  # fabric_max_error_rate and the others (api/batch_limits.py)
        source = files.get(input_file_id, owner)
        if source is None or source.purpose != PURPOSE_INPUT:
            raise not_found("file", input_file_id, param="input_file_id")
        key = request.headers.get("idempotency-key")
        batch_id = idempotent_batch_id(owner, key) if key else new_batch_id()
        now = int(time.time())
        answer = dispatch.promise(  # before anything is stored: the deadline's answer
            files.content_path(source), settings.models, now + window_s, priority_of(metadata)
        )
        if answer is not None and answer.at_risk and strict_deadline(metadata):
            raise ApiError(
                400,
                f"refused ({STRICT_KEY}): {answer.words}; nothing was created. Add workers, "
                "give a longer completion_window, or leave out the metadata "
                f"{STRICT_KEY}",
                param="completion_window",
                code="deadline_at_risk",
            )
        record = BatchRecord(
            id=batch_id,
            owner=owner,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=window,
            metadata=metadata,
            created_at=now,
            expires_at=now + window_s,
        )
        record, made = batches.create(record)
        if not made and (record.input_file_id != input_file_id or record.endpoint != endpoint):
            raise ApiError(
                409,
                f"Idempotency-Key {key!r} was used for batch {batch_id} of another input file "
                "or endpoint; use a new key for a new batch",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        out = batch_object(record)
        return promised(out, answer) if made and answer is not None else out

    @app.get("/v1/batches")
    def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
        owner = owner_of(request)
        if not 1 <= limit <= 100:
            raise invalid(f"limit {limit} must be between 1 and 100", param="limit")
        mine = [r for r in batches.all() if r.owner == owner]
        mine.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        objects = [batch_object(r) for r in mine]
        return _page(objects, after, limit)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(request: Request, batch_id: str) -> dict:
        record = batches.get(batch_id, owner_of(request))
        if record is None:
            raise not_found("batch", batch_id)
        return batch_object(record)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(request: Request, batch_id: str) -> dict:
        record = batches.get(batch_id, owner_of(request))
        if record is None:
            raise not_found("batch", batch_id)
        if record.ended:
            raise ApiError(
                409,
                f"Cannot cancel a batch with status '{record.status}'.",
                code="batch_not_cancellable",
            )
        batches.request_cancel(batch_id)
        return batch_object(record)

    return app


def _file_object(files: FileStore, record) -> dict:
    if record.batch_id is None:
        return record.to_openai()
    try:  # an output file still growing: its size now
        return record.to_openai(files.content_path(record).stat().st_size)
    except FileNotFoundError:
        return record.to_openai()


def _page(objects: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list page: the objects after the one with id `after`, at most `limit`."""
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    page = objects[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(objects) > limit,
    }


def _whole_lines(handle) -> int:
    """Bytes up to the last newline: a file still being appended to is served in whole lines."""
    size = os.fstat(handle.fileno()).st_size
    back = min(size, 1 << 20)
    while back:
        handle.seek(size - back)
        tail = handle.read(back)
        cut = tail.rfind(b"\n")
        if cut >= 0:
            handle.seek(0)
            return size - back + cut + 1
        if back == size:
            break
        back = min(size, back * 2)
    handle.seek(0)
    return 0


def _stream(handle, size: int):
    """The first `size` bytes of an open file, a block at a time; closes it."""
    try:
        left = size
        while left > 0:
            block = handle.read(min(READ_BLOCK, left))
            if not block:
                break
            left -= len(block)
            yield block
    finally:
        handle.close()
