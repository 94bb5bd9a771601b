"""The vllm engine: a clear error without vLLM, its glue on a stand-in LLM, and real runs
wherever vLLM is importable: on a GPU host (`pip install vllm`) or on vLLM's CPU build (the
README's test command installs it, and CI runs them).

Without vLLM the real runs are skipped with the reason (in CI, or with FABRIC_EXPECT_VLLM=1,
they fail instead). They load FABRIC_VLLM_MODEL (default `smollm2`: SmolLM2 written from the
pinned GGUF once and cached, gpu/engines/smollm2_dir.py; nothing is downloaded) in runner
`generate`, and FABRIC_VLLM_EMBED_MODEL (default the same SmolLM2, which vLLM's pooling runner
serves as an embedding model, on the CPU build too: the last token's hidden state, normalised)
in runner `pooling`. One engine per runner (tests/vllm_runs.py `started`), shared with
tests/test_engine_contract.py and closed before tests/test_vllm_broker.py's broker starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from smollm2 import with_torch
from vllm_runs import on_vllm, started

import gpu.engines.vllm as ve
from gpu.engines.base import EMBED, GENERATE, EngineBatch, EngineError
from gpu.engines.registry import make_engine
from gpu.engines.vllm import VllmEngine
from pipeline.store.segment_format import SLOT_HEADER_WORDS  # batches are views into whole slots


def batch_of(ids: list[list[int]], lane: int, task=GENERATE, max_tokens=8, **shape) -> EngineBatch:
    slots = np.zeros((len(ids), SLOT_HEADER_WORDS + lane), np.uint32)
    for row, item in enumerate(ids):
        slots[row, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + len(item)] = item
    lengths = np.array([len(item) for item in ids], np.uint32)
    batch = EngineBatch(task, slots[:, SLOT_HEADER_WORDS:], lengths, max_tokens)
    if shape:
        batch.shape = shape
    return batch


def outputs(result) -> list[list[int]]:
    o = result.offsets
    return [result.tokens[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]


def test_selecting_vllm_without_it_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    with pytest.raises(EngineError) as refused:
        make_engine("vllm", model="Qwen/Qwen2.5-0.5B-Instruct")
    message = str(refused.value)
    assert "vllm is not installed" in message and sys.executable in message
    assert "pip install vllm" in message and "transformers engine" in message


# ---- the glue, on a stand-in for vllm.LLM ------------------------------------------------------
@dataclass
class FakeParams:
    n: int
    temperature: float
    top_p: float
    seed: int | None
    max_tokens: int
    stop: list[str] | None
    stop_token_ids: list[int] | None
    detokenize: bool


@dataclass
class FakeLLM:
    """Answers each prompt with a scripted completion; records what it was sent."""

    script: list = field(default_factory=list)  # (token_ids, finish_reason, stop_reason)
    sent: list = field(default_factory=list)
    llm_engine: object = None

    def __post_init__(self):
        config = SimpleNamespace(get_vocab_size=lambda: 100, max_model_len=32)
        self.llm_engine = SimpleNamespace(model_config=config)

    def get_tokenizer(self):
        return SimpleNamespace(decode=lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))

    def generate(self, prompts, params, use_tqdm):
        self.sent.append((prompts, params))
        script = self.script or [([5], "length", None)] * len(prompts)
        self.script = []
        completions = [
            SimpleNamespace(token_ids=t, finish_reason=f, stop_reason=s) for t, f, s in script
        ]
        return [SimpleNamespace(outputs=[c]) for c in completions[: len(prompts)]]

    def embed(self, prompts, use_tqdm):
        self.sent.append((prompts, None))
        vectors = [[float(len(p["prompt_token_ids"])), 1.0, 0.0] for p in prompts]
        return [SimpleNamespace(outputs=SimpleNamespace(embedding=v)) for v in vectors]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(ve, "vllm_installed", lambda: True)

    def attached(runner: str = "generate") -> tuple[VllmEngine, FakeLLM]:
        engine = VllmEngine(model="stand-in", runner=runner)
        llm = FakeLLM()
        engine.attach(llm, FakeParams)
        llm.sent.clear()
        return engine, llm

    return attached


def test_stop_tokens_and_stop_strings_are_cut_as_the_transformers_engine_does(fake):
    engine, llm = fake()
    llm.script = [
        ([7, 8, 2], "stop", None),  # EOS: vLLM appends it; it goes
        ([7, 8, 9], "length", None),  # max_tokens: all kept
        ([7, 8, 11], "stop", 11),  # a stop token id: it goes
        ([7, 8, 23, 0, 4], "stop", "xa"),  # "hixae": the text before "xa" is "hi"
    ]
    result = engine.run(batch_of([[1], [2, 3], [4], [5]], lane=8, max_tokens=3, stop="xa"))
    assert result.errors == [None] * 4
    assert outputs(result) == [[7, 8], [7, 8, 9], [7, 8], [7, 8]]
    prompts, params = llm.sent[0]
    assert prompts[1] == {"prompt_token_ids": [2, 3]}
    assert params == FakeParams(1, 0.0, 1.0, None, 3, ["xa"], None, True)


def test_sampling_follows_the_shape_and_bad_items_never_reach_vllm(fake):
    engine, llm = fake()
    batch = batch_of([[1, 2], [], [150], [3] * 30], lane=32, max_tokens=4, temperature=0.8, seed=9)
    result = engine.run(batch)
    assert result.errors[0] is None
    assert "no tokens" in result.errors[1]
    assert "outside the model's vocabulary of 100" in result.errors[2]
    assert "passes the model's context of 32" in result.errors[3]
    assert outputs(result) == [[5], [], [], []]
    prompts, params = llm.sent[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}]
    assert (params.temperature, params.seed, params.stop, params.detokenize) == (
        0.8,
        9,
        None,
        False,
    )


def test_each_runner_serves_its_own_task(fake):
    engine, _ = fake("pooling")
    assert engine.dim == 3
    result = engine.run(batch_of([[1, 2, 3], [], [4]], lane=8, task=EMBED))
    assert result.embeddings.dtype == np.float32
    assert result.embeddings.tolist() == [[3.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert result.errors[0] is None and "no tokens" in result.errors[1]
    wrong = engine.run(batch_of([[1]], lane=8))
    assert "only embeds" in wrong.errors[0] and "/v1/embeddings" in wrong.errors[0]
    generator, _ = fake("generate")
    wrong = generator.run(batch_of([[1]], lane=8, task=EMBED))
    assert "only generates" in wrong.errors[0] and "runner = pooling" in wrong.errors[0]


@with_torch
def test_out_of_memory_in_vllm_is_transient_and_other_failures_are_not(fake):
    import torch

    from gpu.engines.base import TransientEngineError

    engine, llm = fake()

    def out_of_memory(prompts, params, use_tqdm):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    llm.generate = out_of_memory
    with pytest.raises(TransientEngineError, match=r"vllm engine: out of memory for a batch of 2"):
        engine.run(batch_of([[1], [2, 3]], lane=8))

    def broken(prompts, params, use_tqdm):
        raise RuntimeError("engine core died")

    llm.generate = broken
    with pytest.raises(RuntimeError, match="engine core died"):
        engine.run(batch_of([[1]], lane=8))


def test_a_dead_engine_process_makes_the_engine_broken_and_close_shuts_vllm_down(fake):
    engine, llm = fake()
    process = SimpleNamespace(name="EngineCore_DP0", pid=4321, exitcode=None)
    stopped = []
    llm.llm_engine.engine_core = SimpleNamespace(
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[process])),
        shutdown=lambda: stopped.append(True),
    )
    assert engine.broken() is None
    process.exitcode = -9  # SIGKILL: vLLM's own client would wait on it for ever
    assert engine.broken() == "vLLM's process EngineCore_DP0 (pid 4321) exited (-9)"
    engine.close()
    assert stopped == [True] and engine.broken() is None
    engine.close()  # once closed, again is nothing
    assert stopped == [True]


def test_a_memory_share_the_cpu_backend_would_refuse_is_refused_first_in_its_terms(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert ve.cpu_memory_refusal(0.1, str(meminfo)) is None
    refused = ve.cpu_memory_refusal(0.9, str(meminfo))
    assert refused == (
        "vllm engine: gpu_memory_utilization = 0.9 reserves 20.6 GiB of the host's 22.9 GiB "
        "RAM, 11.4 GiB available: vLLM's CPU backend refuses; lower it (unset: 0.1)"
    )
    assert ve.cpu_memory_refusal(0.9, str(tmp_path / "none")) is None  # vLLM's check decides


def test_a_model_is_required_and_options_are_checked(fake, monkeypatch):
    monkeypatch.delenv(ve.MODEL_ENV, raising=False)
    with pytest.raises(EngineError, match=r"no model given.*FABRIC_VLLM_MODEL"):
        VllmEngine()
    monkeypatch.setenv(ve.MODEL_ENV, "/models/small")
    assert VllmEngine().model == "/models/small"
    with pytest.raises(EngineError, match="runner = 'embed'"):
        VllmEngine(runner="embed")
    with pytest.raises(EngineError, match=r"gpu_memory_utilization = 1\.5"):
        VllmEngine(gpu_memory_utilization=1.5)
    assert VllmEngine(enforce_eager="false").llm_options["enforce_eager"] is False  # --option
    assert VllmEngine(enforce_eager="true").llm_options["enforce_eager"] is True
    with pytest.raises(EngineError, match="enforce_eager = 'yes please'"):
        VllmEngine(enforce_eager="yes please")


# ---- real vLLM ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def generator(vllm_host):
    return started("generate")


@pytest.fixture(scope="module")
def embedder(vllm_host):
    return started("pooling")


def encode(engine, texts: list[str], chat: bool = False) -> list[list[int]]:
    tokenizer = engine._llm.get_tokenizer()
    if chat:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            )
            for t in texts
        ]
    return [tokenizer.encode(t, add_special_tokens=not chat) for t in texts]


@on_vllm
def test_generation_respects_max_tokens_eos_and_stop_strings(generator):
    prompts = encode(generator, ["What is 2+2? Answer with a number only.", "Name a colour."], True)
    prompts.append(encode(generator, ["The capital of France is"])[0])
    assert len({len(p) for p in prompts}) == 3
    result = generator.run(batch_of(prompts, lane=128, max_tokens=24))
    assert result.errors == [None] * 3
    answers = outputs(result)
    assert all(1 <= len(a) <= 24 for a in answers)
    eos = generator._llm.get_tokenizer().eos_token_id
    assert len(answers[0]) < 24 and answers[0][-1] != eos  # it answers, then EOS (cut)
    assert "4" in generator._decode(answers[0])
    short = outputs(generator.run(batch_of(prompts, lane=128, max_tokens=3)))
    assert all(len(s) <= 3 for s in short)
    cut = outputs(generator.run(batch_of(prompts[2:], lane=128, max_tokens=24, stop=["."])))
    assert "." not in generator._decode(cut[0])


@on_vllm
def test_embeddings_rank_paraphrases_first(embedder):
    texts = [
        "A man is playing a guitar.",
        "Someone plays an acoustic guitar.",
        "The stock market fell sharply today.",
    ]
    ids = encode(embedder, texts)
    result = embedder.run(batch_of(ids, lane=64, task=EMBED))
    assert result.errors == [None] * 3
    vectors = result.embeddings
    assert vectors.dtype == np.float32 and vectors.shape[0] == 3
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] + 0.1
