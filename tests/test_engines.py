"""The echo and simulated engines keep the engine contract."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.engines.base import EMBED, GENERATE, EngineBatch, EngineError
from gpu.engines.registry import make_engine


def batch(task: str, max_tokens: int = 4) -> EngineBatch:
    tokens = np.zeros((3, 8), np.uint32)
    lengths = np.array([2, 8, 5], np.uint32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = np.arange(1, n + 1) + 10 * i
    return EngineBatch(task, tokens, lengths, max_tokens)


def test_echo_returns_the_prompt():
    engine = make_engine("echo")
    engine.load()
    result = engine.run(batch(GENERATE, max_tokens=4))
    assert result.errors == [None, None, None]
    assert result.offsets.tolist() == [0, 2, 6, 10]
    assert result.tokens[:2].tolist() == [1, 2] and result.tokens[2:6].tolist() == [11, 12, 13, 14]
    embedded = engine.run(batch(EMBED))
    assert embedded.embeddings.shape == (3, 8) and embedded.embeddings[0, 1] == 2.0


def test_simulated_takes_the_time_of_its_tokens_and_is_deterministic():
    slept = []
    engine = make_engine("simulated", tokens_per_s=1000.0, sleep=slept.append)
    first = engine.run(batch(EMBED))
    assert slept == [pytest.approx(15 / 1000)]
    again = engine.run(batch(EMBED))
    assert np.array_equal(first.embeddings, again.embeddings)
    assert first.embeddings.shape == (3, 384)
    assert np.allclose(np.linalg.norm(first.embeddings, axis=1), 1.0, atol=1e-5)
    generated = engine.run(batch(GENERATE, max_tokens=5))
    assert slept[-1] == pytest.approx((15 + 3 * 5) / 1000)
    assert generated.offsets.tolist() == [0, 5, 10, 15] and len(generated.tokens) == 15


def test_unknown_engines_and_bad_options_are_refused_by_name():
    with pytest.raises(
        EngineError,
        match="engine 'nonesuch' is not available here; known engines: echo, minilm, openai, "
        "simulated, transformers, vllm",
    ):
        make_engine("nonesuch")
    with pytest.raises(EngineError, match="tokens_per_s = 0"):
        make_engine("simulated", tokens_per_s=0)


def test_out_of_memory_is_recognised_whichever_library_says_it():
    from gpu.engines.base import out_of_memory

    class OutOfMemoryError(RuntimeError):  # torch's class name
        pass

    assert out_of_memory(MemoryError())
    assert out_of_memory(OutOfMemoryError("no text"))
    assert out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory"))
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert out_of_memory(RuntimeError("std::bad_alloc"))
    try:
        try:
            raise MemoryError()
        except MemoryError as inner:
            raise RuntimeError("engine core died") from inner
    except RuntimeError as outer:
        assert out_of_memory(outer)  # wrapped: the cause says it
    assert not out_of_memory(RuntimeError("invalid input shape"))
    assert not out_of_memory(ValueError("token id 99999 is outside the vocabulary"))


def test_an_engine_cannot_bypass_the_out_of_memory_rule():
    from gpu.engines.base import Engine

    with pytest.raises(TypeError, match=r"overrides Engine\.run; implement infer"):

        class Bypass(Engine):
            def run(self, batch):
                return None
