"""An OpenAI-compatible server and a fault-injecting proxy, on loopback, for the `openai` engine.

| helper       | what it is                                                              |
|--------------|-------------------------------------------------------------------------|
| `FakeOpenAI` | answers `/v1/completions` with the prompt's words reversed (greedy; with a `temperature` and a `seed`, shuffled by the seed; unseeded, as greedy), cut to `max_tokens`, its text cut before the first of `stop` (as vLLM, even inside a word), and `/v1/embeddings` with `[tokens, first id, sum of ids]`; `usage.prompt_tokens` is the prompt's tokens + `EXTRA_PROMPT_TOKENS` (a server that adds its own), so a test sees that the upstream's usage is the line's; a prompt with the word `REFUSED_WORD` gets a 400 with `REFUSED_MESSAGE`; `latency_s` delays every answer; a prompt of more than `context_tokens` (plus `max_tokens` when generating) gets vLLM's 400 |
| `FaultProxy` | sits between engine and server; each request is answered per its plan: the next action of `script`, else `mode`: `pass` (forwarded), `429` (with `Retry-After: retry_after`), `500`, `stall` (read, then silence for `stall_s`, then close), `drop` (forwarded, then half the body and close), `down` (closed at once, no answer), `oom` (the 500 a server out of GPU memory answers). `counts` says how often each action was taken; `in_flight` / `most_in_flight` the requests it holds at once |

Both are real HTTP servers on real loopback sockets (`ThreadingHTTPServer`, HTTP/1.1 keep-alive).
`openai_engine(tokenizer_path, base_url=..., **options)` is the engine loaded against one;
`shared_upstream()` one upstream for the whole test process (the contract suite's).
"""

from __future__ import annotations

import collections
import functools
import http.client
import json
import random
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from broker import build_tokenizer, free_port

from gpu.engines.base import Engine
from gpu.engines.registry import make_engine

REFUSED_WORD = "w999"
REFUSED_MESSAGE = "the word w999 is not allowed here (a test's 400)"
EXTRA_PROMPT_TOKENS = 3
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (a test's 500)"
SHARED_CONTEXT_TOKENS = 64  # `shared_upstream()`'s context


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


class _Backlogged(ThreadingHTTPServer):
    """A listen backlog of 128, not socketserver's 5: the engine opens up to its concurrency
    at once, and on a loaded host the proxy's connections to the upstream overflowed 5 (a
    reset the proxy turned into a closed connection, which the engine rightly sent again,
    so the tests counted more requests than items)."""

    request_queue_size = 128


class _Server:
    def __init__(self, handler) -> None:
        self.port = free_port()
        self.httpd = _Backlogged(("127.0.0.1", self.port), handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.closing = threading.Event()  # ends a latency or a stall the server is playing

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _UpstreamHandler(_Quiet):
    def do_POST(self) -> None:
        owner: FakeOpenAI = self.server.owner
        request = json.loads(self.body())
        if not self.path.startswith("/v1/"):
            self.answer(404, b'{"error": {"message": "no such route (a test\'s 404)"}}')
            return
        owner.closing.wait(owner.latency_s)  # a slow server, until it closes
        prompt = request.get("prompt", request.get("input"))
        ids = owner.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        words = owner.tokenizer.decode(ids).split()
        if REFUSED_WORD in words:
            error = {"error": {"message": REFUSED_MESSAGE, "type": "invalid_request_error"}}
            self.answer(400, json.dumps(error).encode())
            return
        embed = self.path.endswith("/embeddings")
        budget = 0 if embed else int(request.get("max_tokens", 16))
        if owner.context_tokens is not None and len(ids) + budget > owner.context_tokens:
            message = (
                f"This model's maximum context length is {owner.context_tokens} tokens. However, "
                f"you requested {len(ids) + budget} tokens ({len(ids)} in the messages, {budget} "
                "in the completion). Please reduce the length of the messages or completion."
            )
            self.answer(400, json.dumps({"error": {"message": message}}).encode())
            return
        usage = {"prompt_tokens": len(ids) + EXTRA_PROMPT_TOKENS}
        if embed:
            vector = [float(len(ids)), float(ids[0] if ids else 0), float(sum(ids))]
            body = {"object": "list", "data": [{"index": 0, "embedding": vector}], "usage": usage}
        else:
            out = words[::-1]
            seed = request.get("seed")
            if float(request.get("temperature") or 0.0) > 0 and seed is not None:
                random.Random(seed).shuffle(out)  # sampled: the seed's order
            text = " ".join(out[:budget])
            stops = [at for at in (text.find(s) for s in request.get("stop") or ()) if at >= 0]
            text = text[: min(stops)] if stops else text
            usage["completion_tokens"] = len(text.split())
            choice = {"index": 0, "text": text, "finish_reason": "stop" if stops else "length"}
            body = {"object": "text_completion", "choices": [choice], "usage": usage}
        with owner.lock:
            owner.answered += 1
        self.answer(200, json.dumps(body).encode())


class FakeOpenAI(_Server):
    """See the module docstring; `tokenizer_path`: the broker model's tokenizer.json."""

    def __init__(
        self, tokenizer_path, latency_s: float = 0.0, context_tokens: int | None = None
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.latency_s = latency_s
        self.context_tokens = context_tokens
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
        except OSError:  # the engine gave up on this request (its timeout), or the upstream
            self.close_connection = True  # is down or too slow: closed without an answer
        finally:
            with proxy.lock:
                proxy.in_flight -= 1

    def _act(self, proxy: FaultProxy, action: str, data: bytes) -> None:
        if action == "429":
            error = {"error": {"message": "rate limited (a test's 429)"}}
            self.answer(429, json.dumps(error).encode(), {"Retry-After": proxy.retry_after})
        elif action == "500":
            self.answer(500, b'{"error": {"message": "a test\'s 500"}}')
        elif action == "oom":
            self.answer(500, json.dumps({"error": {"message": OOM_MESSAGE}}).encode())
        elif action in ("stall", "down"):
            if action == "stall":
                proxy.closing.wait(proxy.stall_s)  # a stall, until the proxy closes
            self.close_connection = True
        else:
            conn = http.client.HTTPConnection(
                "127.0.0.1", proxy.upstream_port, timeout=proxy.upstream_timeout_s
            )
            try:  # an upstream too slow: closed here, and the engine's request without answer
                conn.request("POST", self.path, data, {"Content-Type": "application/json"})
                answer = conn.getresponse()
                payload = answer.read()
            finally:
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
        self.upstream_timeout_s = 30.0  # no answer from the upstream for this long: closed
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


def openai_engine(tokenizer_path, **options) -> Engine:
    """The `openai` engine for model "m" with the test tokenizer and `options` (base_url among
    them), loaded."""
    engine = make_engine("openai", **({"model": "m", "tokenizer": str(tokenizer_path)} | options))
    engine.load()
    return engine


@functools.cache
def shared_upstream() -> tuple[FakeOpenAI, Engine]:
    """One `FakeOpenAI` (context `SHARED_CONTEXT_TOKENS`) and an engine on it, for the whole
    test process: both daemon threads, gone with the process."""
    with tempfile.TemporaryDirectory() as folder:  # both read the tokenizer once, at start
        path = build_tokenizer(Path(folder) / "tokenizer.json")
        upstream = FakeOpenAI(path, context_tokens=SHARED_CONTEXT_TOKENS).__enter__()
        return upstream, openai_engine(path, base_url=upstream.base_url)
