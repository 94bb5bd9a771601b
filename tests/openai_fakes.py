"""An OpenAI-compatible server and a fault-injecting proxy, on loopback, for the `openai` engine.

| helper       | what it is                                                              |
|--------------|-------------------------------------------------------------------------|
| `FakeOpenAI` | answers `/v1/completions` with the prompt's words reversed (cut to max_tokens) and `/v1/embeddings` with `[tokens, first id, sum of ids]`; `usage.prompt_tokens` is the prompt's tokens + `EXTRA_PROMPT_TOKENS` (a server that adds its own), so a test sees that the upstream's usage is the line's; a prompt with the word `REFUSED_WORD` gets a 400 with `REFUSED_MESSAGE`; `latency_s` delays every answer |
| `FaultProxy` | sits between engine and server; each request is answered per its plan: the next action of `script`, else `mode`: `pass` (forwarded), `429` (with `Retry-After: retry_after`), `500`, `stall` (read, then silence for `stall_s`, then close), `drop` (forwarded, then half the body and close), `down` (closed at once, no answer). `counts` says how often each action was taken; `in_flight` / `most_in_flight` the requests it holds at once |

Both are real HTTP servers on real loopback sockets (`ThreadingHTTPServer`, HTTP/1.1 keep-alive).
"""

from __future__ import annotations

import collections
import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from broker import free_port

REFUSED_WORD = "w999"
REFUSED_MESSAGE = "the word w999 is not allowed here (a test's 400)"
EXTRA_PROMPT_TOKENS = 3


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # tests read state, not logs
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status: int, payload: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)


class _Server:
    def __init__(self, handler) -> None:
        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _UpstreamHandler(_Quiet):
    def do_POST(self) -> None:
        owner: FakeOpenAI = self.server.owner
        request = json.loads(self.body())
        if not self.path.startswith("/v1/"):
            self.answer(404, b'{"error": {"message": "no such route (a test\'s 404)"}}')
            return
        time.sleep(owner.latency_s)
        prompt = request.get("prompt", request.get("input"))
        ids = owner.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        words = owner.tokenizer.decode(ids).split()
        if REFUSED_WORD in words:
            error = {"error": {"message": REFUSED_MESSAGE, "type": "invalid_request_error"}}
            self.answer(400, json.dumps(error).encode())
            return
        usage = {"prompt_tokens": len(ids) + EXTRA_PROMPT_TOKENS}
        if self.path.endswith("/embeddings"):
            vector = [float(len(ids)), float(ids[0] if ids else 0), float(sum(ids))]
            body = {"object": "list", "data": [{"index": 0, "embedding": vector}], "usage": usage}
        else:
            text = " ".join(reversed(words[: int(request.get("max_tokens", 16))]))
            usage["completion_tokens"] = len(text.split())
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            body = {"object": "text_completion", "choices": [choice], "usage": usage}
        with owner.lock:
            owner.answered += 1
        self.answer(200, json.dumps(body).encode())


class FakeOpenAI(_Server):
    """See the module docstring; `tokenizer_path`: the broker model's tokenizer.json."""

    def __init__(self, tokenizer_path, latency_s: float = 0.0) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.latency_s = latency_s
        self.answered = 0
        self.lock = threading.Lock()
        super().__init__(_UpstreamHandler)


class _ProxyHandler(_Quiet):
    def do_POST(self) -> None:
        proxy: FaultProxy = self.server.owner
        data = self.body()
        action = proxy.next_action()
        with proxy.lock:
            proxy.in_flight += 1
            proxy.most_in_flight = max(proxy.most_in_flight, proxy.in_flight)
        try:
            self._act(proxy, action, data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the engine gave up on this request (its timeout)
        finally:
            with proxy.lock:
                proxy.in_flight -= 1

    def _act(self, proxy: FaultProxy, action: str, data: bytes) -> None:
        if action == "429":
            error = {"error": {"message": "rate limited (a test's 429)"}}
            self.answer(429, json.dumps(error).encode(), {"Retry-After": proxy.retry_after})
        elif action == "500":
            self.answer(500, b'{"error": {"message": "a test\'s 500"}}')
        elif action in ("stall", "down"):
            if action == "stall":
                time.sleep(proxy.stall_s)
            self.close_connection = True
        else:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
            headers = {"Content-Type": "application/json"}
            conn.request("POST", self.path, data, headers)
            answer = conn.getresponse()
            payload = answer.read()
            conn.close()
            if action == "drop":  # the whole length promised, half of it sent
                self.send_response(answer.status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
            else:
                self.answer(answer.status, payload)


class FaultProxy(_Server):
    """See the module docstring."""

    def __init__(self, upstream: FakeOpenAI) -> None:
        self.upstream_port = upstream.port
        self.mode = "pass"
        self.script: collections.deque[str] = collections.deque()
        self.retry_after = "0.2"
        self.stall_s = 2.0
        self.counts: collections.Counter = collections.Counter()
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        super().__init__(_ProxyHandler)

    def next_action(self) -> str:
        with self.lock:
            action = self.script.popleft() if self.script else self.mode
            self.counts[action] += 1
            return action
