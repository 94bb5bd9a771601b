"""Requests answered and seconds spent per route template: the api stage's metrics.

`CountRequests` is a plain ASGI middleware: it sees the response's status as
it is sent and leaves the request body alone. (Starlette's `@app.middleware`
wraps every `receive` of the body in a task group of its own, which took a
fifth of the api stage's CPU during an upload: bench/http_api.py.)

| metric                               | labels                 |
|--------------------------------------|------------------------|
| `fabric_api_requests_total`          | route, method, status  |
| `fabric_api_request_seconds_total`   | route, method          |
"""

from __future__ import annotations

import threading
import time


class RouteStats:
    """Requests answered and seconds spent, per route template."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = {}
        self.seconds: dict[tuple[str, str], float] = {}

    def add(self, route: str, method: str, status: int, seconds: float) -> None:
        with self.lock:
            key = (route, method, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            self.seconds[(route, method)] = self.seconds.get((route, method), 0.0) + seconds

    def stats(self) -> dict:
        with self.lock:
            return {
                "fabric_api_requests_total": dict(self.requests),
                "fabric_api_request_seconds_total": dict(self.seconds),
            }


class CountRequests:
    """ASGI middleware adding every HTTP request to `stats` under its route template ("unmatched"
    when no route took it), with the status it was answered (500 if it raised)."""

    def __init__(self, app, stats: RouteStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.stats.add(path, scope["method"], status, time.perf_counter() - started)
