"""Engines that run a batch's items together by themselves (vLLM, an upstream server) are
handed full batches: the worker does not size their requests to `target_batch_s`.

Before, a `vllm` worker with the default `target_batch_s` (0.2 s) measured its first batch
(64 prompts of 16 new tokens each: seconds on a CPU) and then asked for a few tokens at a
time: one item per batch, so vLLM ran one sequence at a time (bench/vllm_engine.py measured
the pipeline at 8.6% of `LLM.generate`'s items/s, in 44 batches for 48 prompts).
"""

from __future__ import annotations

from gpu.engines.echo import EchoEngine
from gpu.engines.openai import OpenAIEngine
from gpu.engines.simulated import SimulatedEngine
from gpu.engines.vllm import VllmEngine
from gpu.worker.options import WorkerOptions
from gpu.worker.session import Worker

OPTIONS = WorkerOptions("tcp://127.0.0.1:1", "m", batch_tokens=100_000, target_batch_s=0.2)


def test_an_engine_that_batches_by_itself_is_asked_for_the_most_tokens_after_a_slow_batch():
    upstream = OpenAIEngine(base_url="http://127.0.0.1:1/v1", model="m")
    worker = Worker(OPTIONS, upstream)
    assert worker.token_budget() == 100_000
    worker.engine_thread.measured(tokens=64 * 64, seconds=16.0)  # 64 prompts of 64: slow
    assert worker.token_budget() == 100_000  # not 256 tokens/s x 0.2 s = 51: one item
    alone = Worker(OPTIONS, EchoEngine())  # an engine that runs items one by one is still sized
    alone.engine_thread.measured(tokens=64 * 64, seconds=16.0)
    assert alone.token_budget() == 51


def test_vllm_and_openai_batch_by_themselves_and_the_one_by_one_engines_do_not():
    assert VllmEngine.wants_full_batches and OpenAIEngine.wants_full_batches
    assert not EchoEngine.wants_full_batches and not SimulatedEngine.wants_full_batches
