"""What the API shows of dispatch's own view: the demand per model (`GET /v1/fabric/demand`,
an extension route) and, for a batch with a deadline, its projected finish (an extension
field of its metadata). Both come from dispatch's status answer (BROKER_INFO: `demand` and
`deadline_jobs`, docs/dispatch.md "Demand and deadlines"), asked at most once a second
and shared by the routes' threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from api.errors import ApiError
from collector.results_client import DispatchClient
from pipeline.core.errors import FabricError
from pipeline.transport.security import ClientCurve

FRESH_S = 1.0  # an answer younger than this is used again (dispatch refreshes once a second)
ASK_TIMEOUT_S = 2.0


class DispatchView:
    """Dispatch's last status answer, asked again when older than FRESH_S."""

    def __init__(self, address: str | None, curve: ClientCurve | None) -> None:
        self.address = address
        self.curve = curve
        self._lock = threading.Lock()
        self._answer: dict[str, Any] | None = None
        self._at = -1e18

    def status(self) -> dict[str, Any]:
        """BROKER_INFO; FabricError when dispatch does not answer (or none is known)."""
        if self.address is None:
            raise FabricError("no dispatch address was given to this app")
        with self._lock:
            if time.monotonic() - self._at > FRESH_S or self._answer is None:
                with DispatchClient(self.address, ASK_TIMEOUT_S, 1, self.curve) as client:
                    self._answer = client.broker_status()
                self._at = time.monotonic()
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


def add_demand_route(app: FastAPI, view: DispatchView, owner_of: Callable[[Request], str]) -> None:
    @app.get("/v1/fabric/demand")
    def demand(request: Request) -> dict:
        owner_of(request)
        return view.demand()
