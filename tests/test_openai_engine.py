"""The `openai` engine (gpu/engines/openai.py) against a loopback OpenAI-compatible server behind
a fault-injecting proxy (tests/openai_fakes.py): real sockets, real HTTP.

In process: answers map onto items; 429 storms with Retry-After, 500s, stalls past the
timeout and a connection dropped mid-answer are retried (each item answered once); a 400 is
that item's error with the upstream's message; an upstream down past `retry_for_s` makes
the batch transient; AIMD halves and grows. Through a real broker and `run.py worker`:
tests/test_openai_broker.py.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
from broker import build_tokenizer
from openai_fakes import (
    EXTRA_PROMPT_TOKENS,
    OOM_MESSAGE,
    REFUSED_MESSAGE,
    FakeOpenAI,
    FaultProxy,
    openai_engine,
)

from gpu.engines.aimd import AimdGate
from gpu.engines.base import EMBED, GENERATE, EngineBatch, EngineError, TransientEngineError
from gpu.engines.registry import make_engine
from gpu.engines.upstream import retry_after_s


@pytest.fixture
def served(tmp_path):
    """tokenizer, upstream, proxy and an engine factory: the engine talks to the proxy."""
    path = build_tokenizer(tmp_path / "tokenizer.json")
    built = []
    with FakeOpenAI(path) as upstream, FaultProxy(upstream) as proxy:

        def engine(**options):
            built.append(openai_engine(path, **({"base_url": proxy.base_url} | options)))
            return built[-1]

        yield SimpleNamespace(
            tokenizer=upstream.tokenizer, upstream=upstream, proxy=proxy, engine=engine
        )
        for e in built:
            e.close()


def batch_of(tokenizer, texts: list[str], task=GENERATE, max_tokens: int = 8) -> EngineBatch:
    rows = [tokenizer.encode(t).ids for t in texts]
    lane = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), lane), np.uint32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    lengths = np.array([len(r) for r in rows], np.uint32)
    return EngineBatch(task, tokens, lengths, max_tokens)


def texts_of(tokenizer, result) -> list[str | None]:
    bounds = result.offsets.tolist()
    return [
        None if error else tokenizer.decode(result.tokens[a:b].tolist())
        for error, a, b in zip(result.errors, bounds, bounds[1:], strict=False)
    ]


TEXTS = [f"w{i} w{i + 1} w{i + 2}" for i in range(1, 40)]
REVERSED = [" ".join(reversed(t.split())) for t in TEXTS]


def test_each_item_is_one_request_and_the_upstreams_text_and_usage_come_back(served):
    tokenizer, proxy, engine = served.tokenizer, served.proxy, served.engine
    result = engine().run(batch_of(tokenizer, TEXTS))
    assert texts_of(tokenizer, result) == REVERSED
    assert result.prompt_tokens.tolist() == [3 + EXTRA_PROMPT_TOKENS] * len(TEXTS)
    assert proxy.counts == {"pass": len(TEXTS)}
    embedded = engine(prompt="text").run(batch_of(tokenizer, TEXTS[:2], task=EMBED))
    assert embedded.embeddings.tolist()[0] == [3.0, 2.0, 2.0 + 3.0 + 4.0]


@pytest.mark.parametrize("fault", ["429", "500", "stall", "drop", "down"])
def test_faults_are_retried_and_every_item_is_answered_once(served, fault):
    """Retried requests are the same items: the results are the plain run's, in order."""
    tokenizer, proxy, engine = served.tokenizer, served.proxy, served.engine
    proxy.script.extend([fault] * 12)  # the first 12 requests meet the fault
    proxy.stall_s = 3.0  # past timeout_s, which stays above a loaded host's slow answer
    began = time.monotonic()
    e = engine(timeout_s=1.0, retry_for_s=60)
    result = e.run(batch_of(tokenizer, TEXTS))
    assert texts_of(tokenizer, result) == REVERSED
    assert proxy.counts[fault] == 12 and proxy.counts["pass"] == len(TEXTS)
    assert e.retries >= 12 and e.gate.halvings >= 1
    if fault == "429":  # Retry-After 0.2 s holds every request of the engine
        assert time.monotonic() - began >= 0.2


def test_a_400_is_that_items_error_with_the_upstreams_message_and_the_rest_go_on(served):
    tokenizer, engine = served.tokenizer, served.engine
    texts = ["w1 w2", "w3 w999 w4", "w5"]
    result = engine().run(batch_of(tokenizer, texts))
    assert result.errors[0] is None and result.errors[2] is None
    assert REFUSED_MESSAGE in result.errors[1] and "400" in result.errors[1]
    assert texts_of(tokenizer, result) == ["w2 w1", None, "w5"]


def test_an_upstream_down_past_retry_for_s_makes_the_batch_transient(served):
    tokenizer, proxy, engine = served.tokenizer, served.proxy, served.engine
    proxy.mode = "down"
    began = time.monotonic()
    with pytest.raises(TransientEngineError, match="handed back"):
        engine(retry_for_s=1.0).run(batch_of(tokenizer, TEXTS))
    assert time.monotonic() - began < 10  # the other requests stop retrying with it


def test_a_server_out_of_memory_pushes_back_and_the_batch_goes_back_unsplit(served):
    """Out of memory for this engine is the server's (its own batching holds the memory): a
    500 saying so is push-back like any 5xx, retried and halving the concurrency, then the
    whole batch is transient, never split: smaller batches would not make the server's
    memory any larger. (An in-process MemoryError is the common rule, tests/test_engine_contract.py.)"""
    tokenizer, proxy, engine = served.tokenizer, served.proxy, served.engine
    proxy.mode = "oom"
    e = engine(retry_for_s=0.5, start_concurrency=8)
    batch = batch_of(tokenizer, TEXTS[:8])
    with pytest.raises(TransientEngineError, match="handed back") as back:
        e.run(batch)
    assert OOM_MESSAGE in str(back.value) and "batch of 8 items" in str(back.value)
    assert e.gate.halvings >= 1 and e.gate.allowed < 8
    proxy.mode = "pass"  # the server has room again: the same batch, whole, runs
    assert texts_of(tokenizer, e.run(batch)) == REVERSED[:8]


def test_a_refused_key_or_model_breaks_the_engine_and_the_key_is_never_said(served):
    tokenizer, engine = served.tokenizer, served.engine
    with pytest.raises(EngineError, match="FABRIC_TEST_UNSET_KEY"):
        engine(api_key_env="FABRIC_TEST_UNSET_KEY")
    wrong = served.upstream.base_url.replace("/v1", "/v9")
    with pytest.raises(EngineError, match="HTTP 404"):
        engine(base_url=wrong).run(batch_of(tokenizer, TEXTS[:3]))
    os.environ["FABRIC_TEST_KEY"] = "sk-secret-value"
    try:
        e = engine(api_key_env="FABRIC_TEST_KEY")
        assert "sk-secret" not in repr(vars(e)) and e.figures()["concurrency"] >= 1
    finally:
        del os.environ["FABRIC_TEST_KEY"]


def test_aimd_adds_one_per_round_of_good_answers_and_halves_once_per_push_back():
    clock = [0.0]
    gate = AimdGate(maximum=16, start=4, latency_target_s=0.5, now=lambda: clock[0])
    for _ in range(4):  # one round at 4 in flight: +1
        gate.release(gate.acquire(), ok=True)
    assert gate.allowed == 4 or gate.allowed == 5
    for _ in range(40):
        gate.release(gate.acquire(), ok=True)
    grown = gate.allowed
    assert grown >= 8
    starts = [gate.acquire() for _ in range(3)]  # three in flight, all sent before the 429s
    clock[0] += 0.1
    for started in starts:
        gate.release(started, ok=False)
    assert gate.allowed == grown // 2 and gate.halvings == 1  # one push-back: one halving
    started = gate.acquire()
    clock[0] += 1.0  # slower than the 0.5 s target: halves again
    gate.release(started, ok=True)
    assert gate.allowed == grown // 4
    for _ in range(200):
        gate.release(gate.acquire(), ok=True)
    assert gate.allowed == 16  # and never above max_concurrency


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after_s("2") == 2.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now_s=1445412470.0) == 10.0
    assert retry_after_s("soon") is None and retry_after_s(None) is None


def test_a_local_openai_worker_gets_its_models_tokenizer_and_its_groups_options(tmp_path):
    from broker import write_config

    from config import load_settings
    from config.stage_settings import worker_settings
    from gpu.worker.options import WorkerOptions

    config = write_config(tmp_path, workers=0)
    tokenizer = tmp_path / "tokenizer.json"
    group = (
        '[[workers]]\nmodel = "up"\ncount = 1\n'
        'options = {base_url = "http://127.0.0.1:9/v1", model = "m", latency_target_ms = 500}\n'
    )
    text = config.read_text().replace("[workers]\nlocal = 0\n", group)
    config.write_text(
        text + f'[[models]]\nname = "up"\nengine = "openai"\ntokenizer = "{tokenizer}"\n'
    )
    options = WorkerOptions.from_settings(worker_settings(load_settings(config), 0))
    assert (options.engine, options.model) == ("openai", "up")
    assert options.engine_options == {
        "tokenizer": str(tokenizer),
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "latency_target_ms": 500,
    }
    engine = make_engine(options.engine, **options.engine_options)
    assert engine.gate.latency_target_s == 0.5
