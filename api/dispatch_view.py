"""What the API shows of dispatch's own view: the demand per model (`GET /v1/fabric/demand`,
an extension route) and, for a batch with a deadline, its projected finish (an extension
field of its metadata). Both come from dispatch's status answer (BROKER_INFO: `demand` and
`deadline_jobs`, docs/dispatch.md "Demand and deadlines"), asked at most once a second
and shared by the routes' threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from api.errors import ApiError
from collector.results_client import DispatchClient
from config.settings import ModelSettings
from gpu.dispatch.promise import Promise, lines_per_model, promise
from pipeline.core.deadline_words import deadline_words
from pipeline.core.errors import FabricError
from pipeline.store.job_files import JobFiles
from pipeline.store.job_record import JobRecordError
from pipeline.transport.security import ClientCurve

PROJECTED_KEY = "fabric_projected_finish_at"  # metadata: unix seconds, as a string
AT_RISK_KEY = "fabric_deadline_at_risk"  # metadata: "true" or "false"
DEADLINE_KEY = "fabric_deadline_status"  # metadata: "on track (projected 04:10)", ...
STRICT_KEY = "fabric_deadline_strict"  # metadata: "true" refuses a batch projected late
FRESH_S = 1.0  # an answer younger than this is used again (dispatch refreshes once a second)
ASK_TIMEOUT_S = 2.0


class DispatchView:
    """Dispatch's last status answer, asked again when older than FRESH_S."""

    def __init__(self, address: str | None, curve: ClientCurve | None) -> None:
        self.address = address
        self.curve = curve
        self._lock = threading.Lock()
        self._answer: dict[str, Any] | None = None
        self._error: FabricError | None = None
        self._client: DispatchClient | None = None
        self._at = -1e18

    def close(self) -> None:
        """Close the client to dispatch (a new one is made when asked again)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def status(self) -> dict[str, Any]:
        """BROKER_INFO; FabricError when dispatch does not answer (or none is known)."""
        if self.address is None:
            raise FabricError("no dispatch address was given to this app")
        with self._lock:
            if time.monotonic() - self._at > FRESH_S:
                self._at = time.monotonic()  # a failure too is not asked again for FRESH_S
                try:
                    if self._client is None:  # one client, kept (under the lock)
                        self._client = DispatchClient(self.address, ASK_TIMEOUT_S, 1, self.curve)
                    self._answer, self._error = self._client.broker_status(), None
                except FabricError as exc:
                    self._answer, self._error = None, exc
                    self.close()  # a fresh socket next time
            if self._answer is None:
                raise self._error or FabricError("dispatch did not answer")
            return self._answer

    def demand(self) -> dict[str, Any]:
        """The answer of `GET /v1/fabric/demand`: one entry per model."""
        try:
            rows = self.status().get("demand", {})
        except FabricError as exc:
            raise ApiError(
                503,
                f"dispatch at {self.address} did not answer ({exc}); try again shortly",
                type="server_error",
                code="dispatch_unavailable",
            ) from exc
        return {"object": "list", "data": [{"model": m, **row} for m, row in sorted(rows.items())]}

    def projection(self, job_no: int) -> dict[str, Any] | None:
        """Dispatch's projection of an unfinished job with a deadline, or None (no such job,
        or dispatch did not answer: the batch object goes without it)."""
        try:
            return self.status().get("deadline_jobs", {}).get(str(job_no))
        except FabricError:
            return None

    def promise(
        self, path: Path, models: Sequence[ModelSettings], deadline_s: float, priority: int
    ) -> Promise | None:
        """The answer for a batch about to be created from the input file at `path`, due at
        `deadline_s` (gpu/dispatch/promise.py); None when dispatch does not answer."""
        try:
            info = self.status()
        except FabricError:
            return None
        return promise(info, lines_per_model(path, models), deadline_s, priority)

    def with_projection(self, batch: dict[str, Any], job_no: int | None) -> dict[str, Any]:
        """OpenAI's Batch object `batch` with, in its metadata (string values, so the official
        client's type still validates), its job's live projection: when it should finish,
        whether its deadline (`expires_at`) is at risk, and the sentence a user reads."""
        row = self.projection(job_no) if job_no is not None else None
        if row is None:
            return batch
        extra = {
            DEADLINE_KEY: deadline_words(row, time.time()),
            AT_RISK_KEY: "true" if row["at_risk"] else "false",
        }
        if not row["measured"]:
            del extra[AT_RISK_KEY]  # not known: no guess
        if row["projected_finish_s"] is not None:
            extra[PROJECTED_KEY] = str(int(row["projected_finish_s"]))
        return {**batch, "metadata": {**(batch.get("metadata") or {}), **extra}}


class JobNumbers:
    """A batch's job number (its job is named after the batch), read once from the record."""

    def __init__(self, data_root: Path) -> None:
        self.files = JobFiles(data_root)
        self._known: dict[str, int] = {}

    def of(self, job_id: str) -> int | None:
        """None while the job has no record (a batch still validating)."""
        if job_id not in self._known:
            try:
                self._known[job_id] = int(self.files.read_record(job_id)["job_no"])
            except (FileNotFoundError, JobRecordError, OSError, KeyError):
                return None
        return self._known[job_id]


def strict_deadline(metadata: dict[str, str] | None) -> bool:
    return str((metadata or {}).get(STRICT_KEY, "")).lower() in ("true", "1", "yes")


def promised(batch: dict[str, Any], answer: Promise) -> dict[str, Any]:
    """The Batch object just created, with the submit-time answer in its metadata."""
    extra = {DEADLINE_KEY: answer.words}
    if answer.measured:
        extra[AT_RISK_KEY] = "true" if answer.at_risk else "false"
    if answer.finish_s is not None:
        extra[PROJECTED_KEY] = str(int(answer.finish_s))
    return {**batch, "metadata": {**(batch.get("metadata") or {}), **extra}}


def add_demand_route(app: FastAPI, view: DispatchView, owner_of: Callable[[Request], str]) -> None:
    @app.get("/v1/fabric/demand")
    def demand(request: Request) -> dict:
        owner_of(request)
        return view.demand()
