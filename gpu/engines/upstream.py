"""One HTTP/JSON conversation with an OpenAI-compatible server, as the `openai` engine has it.

`Upstream.post(path, body)` sends one request on this thread's own keep-alive connection
(stdlib `http.client`; a connection that failed, or that the server closed while it idled,
is closed and the request goes on a new one) and sorts the answer into one of three:

| answer                                             | returned / raised                      |
|----------------------------------------------------|----------------------------------------|
| 2xx with a JSON body                               | the body (a dict)                      |
| 429, 5xx, a connection refused, reset or dropped mid-answer, no byte for `timeout_s`, a body that is not JSON | `PushBack` (retry later; its `retry_after_s` from the `Retry-After` header, else None) |
| 401, 403, 404                                      | `UpstreamRefused` (a configuration fault: wrong key, wrong model or URL) |
| any other 4xx                                      | `ItemRefused` with the upstream's own message (that request's fault) |

The API key is sent as `Authorization: Bearer ...` and never put in a message.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import select
import socket
import threading
import time
import urllib.parse

from gpu.engines.base import EngineError


class PushBack(Exception):
    """The upstream cannot answer now (429, 5xx, a connection fault): retry later."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class ItemRefused(Exception):
    """The upstream refused this request (a 4xx other than 401, 403, 404, 408, 429)."""


class UpstreamRefused(EngineError):
    """The upstream refuses every request (401, 403, 404): the engine is misconfigured."""


def retry_after_s(value: str | None, now_s: float | None = None) -> float | None:
    """A `Retry-After` header in seconds from now: delta-seconds or an HTTP date; None when
    absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now_s is None else now_s))


def upstream_message(raw: bytes) -> str:
    """The upstream's error text: OpenAI's `{"error": {"message": ...}}`, or the body itself."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:500]
    return text[:500]


def dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether the server closed this idle kept-alive connection (or wrote on it unasked): it
    is readable before a request was sent on it. Servers close connections idle past their
    keep-alive timeout (uvicorn's, under vLLM's server: 5 s), so after any pause between
    batches each thread's connection is gone; sending on it anyway failed every thread's
    first request, counted as the server pushing back: the concurrency halved to 1 and took
    about a hundred answers to grow back (bench/openai_engine.py measured 80% of a direct
    client's items/s that way)."""
    if conn.sock is None:
        return True
    poll = select.poll()
    poll.register(conn.sock, select.POLLIN)
    return bool(poll.poll(0))


class Upstream:
    """An OpenAI-compatible server at `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise EngineError(
                f"openai engine: base_url = {base_url!r} is not an http(s) URL; give the "
                "server's OpenAI root, e.g. base_url=http://127.0.0.1:8000/v1"
            )
        self.base_url = base_url
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's, for close_all
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and dropped(conn):
            self.close()  # the server closed it while it idled: a new one, not a push-back
            conn = None
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.connect_timeout_s)
            conn.connect()
            conn.sock.settimeout(self.timeout_s)  # a stall: no byte for this long
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def close(self) -> None:
        """Close this thread's connection (the next request opens a new one)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def close_all(self) -> None:
        """Close every thread's connection (the engine is done)."""
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()

    def post(self, path: str, body: dict) -> dict:
        """POST `body` as JSON to base_url + path; see the module docstring for the answers."""
        data = json.dumps(body).encode("utf-8")
        try:
            conn = self._connection()
            conn.request("POST", self._prefix + path, data, self._headers)
            answer = conn.getresponse()
            raw = answer.read()
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, stalled, cut
            self.close()
            raise PushBack(f"{type(exc).__name__}: {exc or 'connection closed'}") from None
        status = answer.status
        if answer.will_close:
            self.close()
        if 200 <= status < 300:
            try:
                parsed = json.loads(raw)
            except ValueError:
                self.close()
                raise PushBack(f"HTTP {status} with a body that is not JSON") from None
            if not isinstance(parsed, dict):
                raise PushBack(f"HTTP {status} with a JSON body that is not an object")
            return parsed
        said = upstream_message(raw)
        if status in (429, 408) or status >= 500:
            wait = retry_after_s(answer.getheader("Retry-After"))
            raise PushBack(f"HTTP {status}: {said}", wait)
        if status in (401, 403, 404):
            raise UpstreamRefused(
                f"openai engine: {self.base_url}{path} answered HTTP {status} ({said}); check "
                "base_url, the model option and the key in api_key_env"
            )
        raise ItemRefused(f"upstream {self.base_url} answered HTTP {status}: {said}")
