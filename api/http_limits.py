"""The HTTP server's own limits: how much of a request head is read, how many connections are
open, and how long a request head and an idle connection may take.

uvicorn's httptools protocol keeps a request head whole in memory however long it is (a 64
MiB header was read for 26 s, and its memory kept), keeps every connection it accepts, and
waits for a request head for ever. `guarded(limits)` is that protocol with the `[api]`
limits (docs/http-api.md, "Limits"), per api process:

| limit (`[api]`)          | when                                                      | answer |
|--------------------------|-----------------------------------------------------------|--------|
| `max_header_bytes`       | the request line and headers of one request pass it        | 431 `request_header_too_large` |
| `max_connections`        | a connection is accepted while that many are open           | 503 `too_many_connections` |
| `request_head_timeout_s` | a request head is not whole that long after its first byte (a new connection: after it opened) | 408 `request_timeout`; a connection that sent nothing is closed without one |
| `keep_alive_timeout_s`   | a connection is idle that long after a response             | closed (uvicorn's `timeout_keep_alive`) |

A head is counted as it arrives, before it is parsed whole, so a long one costs at most the
limit and one read (256 KiB) of memory. A refused connection is answered with OpenAI's
error body and `Connection: close`, its sending half is shut, and whatever more the client
sends is read and dropped (not kept) for up to `LINGER_S`, so the client reads the answer
rather than a reset; then it is closed.
"""

from __future__ import annotations

import asyncio
import http
from dataclasses import dataclass

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import ApiError

LINGER_S = 2.0  # a refused connection's input is read and dropped this long before it closes


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int
    max_connections: int
    request_head_timeout_s: float

    @classmethod
    def of(cls, api) -> HttpLimits:
        """The limits of `[api]` (config/settings.py ApiSettings)."""
        return cls(api.max_header_bytes, api.max_connections, api.request_head_timeout_s)


def guarded(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with `limits` (uvicorn.Config(http=...))."""
    return type("GuardedHttpProtocol", (GuardedHttp,), {"limits": limits})


class GuardedHttp(HttpToolsProtocol):
    """HttpToolsProtocol that refuses a connection past its limits (module docstring)."""

    limits: HttpLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_head = True  # between requests, or in a request's head
        self.head_bytes = 0  # bytes received in this head so far (whole reads)
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                ApiError(
                    503,
                    f"this server has {self.limits.max_connections} connections open, its "
                    "limit (api.max_connections); try again shortly",
                    type="server_error",
                    code="too_many_connections",
                )
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and dropped while the answer lingers
        if self.in_head:
            if self.head_timer is None:
                self._arm_head_timer()
            self.head_bytes += len(data)
        super().data_received(data)
        if self.in_head and self.head_bytes > self.limits.max_header_bytes:
            self._refuse_head()

    # ---- parser callbacks ------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self.in_head = False
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:  # whole in one read: counted exactly here
            self._refuse_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        super().on_message_complete()
        self.in_head = True  # the next bytes are the next request's head
        self.head_bytes = 0

    # ---- refusals --------------------------------------------------------------------------
    def _refuse_head(self) -> None:
        self._refuse(
            ApiError(
                431,
                f"the request's line and headers are over {self.limits.max_header_bytes} "
                "bytes (api.max_header_bytes): send shorter headers",
                code="request_header_too_large",
            )
        )

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(
            self.limits.request_head_timeout_s, self._head_timed_out
        )

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.refused or not self.in_head or self.transport.is_closing():
            return
        if self.head_bytes == 0:  # nothing sent: nothing to answer
            self.transport.close()
            return
        self._refuse(
            ApiError(
                408,
                "the request's line and headers did not arrive within "
                f"{self.limits.request_head_timeout_s:g} s (api.request_head_timeout_s)",
                code="request_timeout",
            )
        )

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` and close: the sending half at once, the connection after
        LINGER_S (its input is dropped meanwhile)."""
        self.refused = True
        self._cancel_head_timer()
        transport = self.transport
        if transport.is_closing():
            return
        body = orjson.dumps(error.body())
        phrase = http.HTTPStatus(error.status).phrase
        head = (
            f"HTTP/1.1 {error.status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)
