"""The `openai` engine after a pause: the server closed its idle keep-alive connections.

Servers close connections idle past their keep-alive timeout (uvicorn's, under vLLM's server:
5 s). Before, the engine sent its next batch on them anyway: every thread's first request
failed, was counted as the server pushing back (a retry each) and halved the concurrency, down
to 1, from where it grew back by one per round of answers (bench/openai_engine.py: 80% of a
direct async client's items/s). Now a connection the server closed is replaced before sending.
"""

from __future__ import annotations

import threading

import numpy as np
from broker import build_tokenizer
from conftest import wait_for
from openai_fakes import FakeOpenAI, openai_engine

from gpu.engines.base import GENERATE, EngineBatch

CONCURRENCY = 4


def closing_idle_connections(upstream: FakeOpenAI, idle_s: float) -> dict[str, int]:
    """Make `upstream` close a connection idle for `idle_s`, as uvicorn does; the returned
    dict counts the connections it `opened` and `closed`."""
    counts = {"opened": 0, "closed": 0}
    lock = threading.Lock()
    handler = upstream.httpd.RequestHandlerClass

    class ClosesIdle(handler):
        timeout = idle_s  # BaseHTTPRequestHandler: a silent connection ends the handler

        def setup(self) -> None:
            super().setup()
            with lock:
                counts["opened"] += 1

        def finish(self) -> None:
            super().finish()
            with lock:
                counts["closed"] += 1

    upstream.httpd.RequestHandlerClass = ClosesIdle
    return counts


def batch(n: int) -> EngineBatch:
    tokens = np.zeros((n, 8), np.uint32)
    tokens[:, :3] = (5, 6, 7)
    return EngineBatch(GENERATE, tokens, np.full(n, 3, np.uint32), max_tokens=3)


def test_connections_the_server_closed_while_idle_are_replaced_not_counted_as_push_back(
    tmp_path,
):
    path = build_tokenizer(tmp_path / "tokenizer.json")
    with FakeOpenAI(path) as upstream:
        counts = closing_idle_connections(upstream, idle_s=0.3)
        engine = openai_engine(
            path,
            base_url=upstream.base_url,
            max_concurrency=CONCURRENCY,
            start_concurrency=CONCURRENCY,
        )
        try:
            first = engine.run(batch(4 * CONCURRENCY))
            assert first.errors == [None] * (4 * CONCURRENCY)
            assert counts["opened"] >= 1
            wait_for(
                lambda: counts["closed"] == counts["opened"],
                "the server to close the idle connections",
            )
            second = engine.run(batch(4 * CONCURRENCY))
            assert second.errors == [None] * (4 * CONCURRENCY)
            assert engine.retries == 0  # no request failed on a closed connection
            assert engine.gate.halvings == 0 and engine.gate.allowed == CONCURRENCY
        finally:
            engine.close()
