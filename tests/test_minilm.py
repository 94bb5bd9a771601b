"""The minilm engine: reference vectors, paraphrases, the hash pin, per-item errors, lane widths."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import gpu.engines.minilm as minilm
from gpu.engines.base import EMBED, EngineBatch, EngineError, TransientEngineError
from gpu.engines.minilm import DIM, MODEL_SHA256, MiniLMEngine, minilm_tokenizer_path
from gpu.engines.registry import make_engine
from pipeline.store.segment_format import SLOT_HEADER_WORDS  # batches are views into whole slots

REFERENCE = Path(__file__).parent / "data" / "minilm_reference.json"


@pytest.fixture(scope="module")
def engine() -> MiniLMEngine:
    engine = make_engine("minilm", threads=2)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text("utf-8"))


def encode(sentences: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(minilm_tokenizer_path()))
    return [e.ids for e in tokenizer.encode_batch(sentences)]


def batch_of(ids: list[list[int]], lane: int, task: str = EMBED) -> EngineBatch:
    """A zero-padded [n, lane] uint32 batch, a non-contiguous view as the worker passes it."""
    slots = np.zeros((len(ids), SLOT_HEADER_WORDS + lane), np.uint32)
    slots[:, :SLOT_HEADER_WORDS] = 0xFFFFFFFF
    for row, item in enumerate(ids):
        slots[row, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + len(item)] = item
    lengths = np.array([len(item) for item in ids], np.uint32)
    return EngineBatch(task, slots[:, SLOT_HEADER_WORDS:], lengths)


def test_tokenizer_json_is_the_one_make_tokenizer_builds():
    build = runpy.run_path(str(minilm_tokenizer_path().with_name("make_tokenizer.py")))["build"]
    committed = json.loads(minilm_tokenizer_path().read_text("utf-8"))
    assert json.loads(build().to_str()) == committed
    assert committed["truncation"]["max_length"] == 256 and committed["padding"] is None
    assert encode(["Hello, World!"]) == [[101, 7592, 1010, 2088, 999, 102]]


def test_vectors_match_the_reference_implementation(engine, reference):
    result = engine.run(batch_of(encode(reference["sentences"]), lane=64))
    assert result.errors == [None] * len(reference["sentences"])
    assert result.embeddings.dtype == np.float32
    assert result.embeddings.shape == (len(reference["sentences"]), DIM)
    expected = np.array(reference["vectors"], np.float32)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    cosines = (result.embeddings * expected).sum(axis=1)
    assert cosines.min() >= 0.995, dict(zip(reference["sentences"], cosines.tolist(), strict=True))
    np.testing.assert_allclose(np.linalg.norm(result.embeddings, axis=1), 1.0, atol=1e-5)


def test_paraphrases_score_above_unrelated_pairs(engine, reference):
    vectors = engine.run(batch_of(encode(reference["sentences"]), lane=64)).embeddings
    similarity = vectors @ vectors.T
    paraphrases = {tuple(pair) for pair in reference["paraphrases"]}
    n = len(vectors)
    unrelated = [
        similarity[i, j] for i in range(n) for j in range(i + 1, n) if (i, j) not in paraphrases
    ]
    assert min(similarity[i, j] for i, j in paraphrases) > max(unrelated) + 0.2


def test_lane_width_and_chunking_do_not_change_a_vector(engine, reference):
    ids = encode(reference["sentences"])
    narrow = engine.run(batch_of(ids, lane=64)).embeddings
    wide = engine.run(batch_of(ids, lane=256)).embeddings
    np.testing.assert_allclose(wide, narrow, atol=1e-5)
    alone = engine.run(batch_of(ids[:1], lane=256)).embeddings
    np.testing.assert_allclose(alone[0], narrow[0], atol=1e-5)
    chunked = MiniLMEngine(threads=1, chunk_tokens=512)  # two rows of 256 per run
    chunked._session = engine._session
    np.testing.assert_allclose(chunked.run(batch_of(ids, lane=256)).embeddings, narrow, atol=1e-5)


def test_a_corrupted_model_is_refused_with_its_hash(tmp_path, monkeypatch):
    data = bytearray(minilm.model_path().read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "model.onnx"
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(minilm, "model_path", lambda: bad)
    with pytest.raises(EngineError) as refused:
        MiniLMEngine(threads=1).load()
    message = str(refused.value)
    assert str(bad) in message and MODEL_SHA256 in message
    assert "found sha256 " in message and "pip install --force-reinstall" in message
    monkeypatch.setattr(minilm, "model_path", lambda: tmp_path / "gone.onnx")
    with pytest.raises(EngineError, match=r"cannot read model file .*gone\.onnx"):
        MiniLMEngine(threads=1).load()


class _FailingSession:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def run(self, outputs, feeds):
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [MemoryError(), RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory for buffer")],
)
def test_out_of_memory_is_transient(exc):
    engine = MiniLMEngine(threads=1)
    engine._session = _FailingSession(exc)
    with pytest.raises(
        TransientEngineError, match="minilm engine: out of memory for a batch of 1 x 64 tokens"
    ):
        engine.run(batch_of([[101, 102]], lane=64))


def test_other_onnxruntime_failures_are_not_transient():
    engine = MiniLMEngine(threads=1)
    engine._session = _FailingSession(RuntimeError("invalid input shape"))
    with pytest.raises(RuntimeError, match="invalid input shape"):
        engine.run(batch_of([[101, 102]], lane=64))


def test_bad_options_are_refused_by_name():
    with pytest.raises(EngineError, match="threads = 0 must be"):
        make_engine("minilm", threads=0)
    with pytest.raises(EngineError, match="chunk_tokens = 100 must be"):
        make_engine("minilm", chunk_tokens=100)


def test_onnxruntime_is_imported_only_when_minilm_is_selected():
    code = (
        "import sys; from gpu.engines.registry import make_engine; make_engine('echo'); "
        "assert 'onnxruntime' not in sys.modules; "
        "make_engine('minilm').load(); assert 'onnxruntime' in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[1]
    )


def test_an_id_beyond_the_vocabulary_is_that_items_error_not_a_crash(engine, reference):
    """Point 6 of issue 14: onnxruntime fails the whole batch on such an id, which killed the
    worker on every try."""
    ids = encode(reference["sentences"][:1])[0]
    batch = batch_of([ids, [101, 30522, 102], [*ids[:3], 2**32 - 1], [101, 30521, 102]], lane=64)
    result = engine.run(batch)
    assert result.errors[0] is None and result.errors[3] is None
    assert "token id 30522 is beyond minilm's vocabulary of 30522" in result.errors[1]
    assert f"token id {2**32 - 1} is beyond" in result.errors[2]
    expected = np.array(reference["vectors"][0], np.float32)
    assert result.embeddings[0] @ expected >= 0.995
