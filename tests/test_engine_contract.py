"""The engine contract (gpu/engines/base.py; docs/engines.md, "The engine contract"), checked
against every engine in the registry, in process, on the engine object itself.

`CONTRACTS` is the parameter table: one entry per engine configuration, saying what the engine
serves and how it answers what it does not. An engine added to `ENGINES` without an entry fails
`test_every_registered_engine_has_a_contract_entry`; adding one is an entry here plus a factory
that returns the engine loaded (cheaply: one per test process, `functools.cache`).

| field        | says |
|--------------|------|
| `tasks`      | the tasks it serves; a batch of another task gets an error for every item |
| `vocab_size` | ids at or past it are an item's error; None: no vocabulary, every uint32 id is served |
| `longest`    | the most tokens an item may take (prompt, plus `max_tokens` when generating); None: no limit |
| `shape`      | what generation does with the shape's sampling and stop strings: FOLLOWS them, IGNORES them (the output is the prompt's alone), or, for an engine that does not generate, REFUSES the batch per item |
| `logprobs`   | whether it returns log probabilities; where not, ingest refuses such a line (`LOGPROB_ENGINES`) |
| `invariant`  | whether an item's greedy output is the same whatever shares its batch (exactly, or within float tolerance for vectors) |

The `openai` entry runs against a loopback OpenAI-compatible server (tests/openai_fakes.py
`shared_upstream`: a word-level tokenizer, a 64-token context, stop strings and seeds followed
as vLLM follows them). What it does not decide itself it answers the server's way: a prompt
too long is the server's 400, that item's error with the server's message. Out of memory in
the client process is the common rule below; the server's own (a 500) is push-back, retried,
then the batch goes back whole (tests/test_openai_engine.py).

SmolLM2's entry runs in the SmolLM2 test process (tests/smollm2.py `MODEL_MARKS`); the vLLM
entries need vLLM, on a GPU or its CPU build (skipped with the reason otherwise, marked `vllm`:
tests/vllm_runs.py `require_vllm_host`), and share its in-process engines (`started`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from openai_fakes import SHARED_CONTEXT_TOKENS, shared_upstream
from smollm2 import MODEL_MARKS, loaded_engine
from vllm_runs import VLLM_MARKS, require_vllm_host, started

from collector.completion.result_check import OK, Expected, ResultCheck, expected_kind
from gpu.engines.base import EMBED, GENERATE, Engine, EngineBatch, TransientEngineError
from gpu.engines.registry import ENGINES, make_engine
from gpu.work_protocol import ITEM_DTYPE
from gpu.worker.results import results_message
from ingest.catalog import COMPLETIONS, EMBEDDINGS, LOGPROB_ENGINES
from pipeline.core import token_logprobs
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.segment_format import SLOT_HEADER_WORDS

FOLLOWS, IGNORES, REFUSES = "follows", "ignores", "refuses"


@dataclass(frozen=True)
class Contract:
    id: str  # the test id: the engine's name, or name-configuration
    engine: str  # its name in the registry
    load: Callable[[], Engine]  # the engine, loaded (cached per process)
    prompts: Callable[[Engine], list[list[int]]]  # three prompts of different lengths it serves
    tasks: frozenset[str]
    vocab_size: int | None
    longest: Callable[[Engine], int | None]
    shape: str  # FOLLOWS, IGNORES or REFUSES (see the module docstring)
    decode: Callable[[Engine], Callable[[list[int]], str]] | None = None  # with FOLLOWS
    logprobs: bool = False
    invariant: bool = True
    marks: tuple = field(default=())

    def param(self):
        return pytest.param(self, id=self.id, marks=self.marks)


# ---- the engines' factories (cheap configurations, one load per process) -----------------------
@functools.cache
def _echo() -> Engine:
    engine = make_engine("echo")
    engine.load()
    return engine


@functools.cache
def _simulated() -> Engine:
    return make_engine("simulated", tokens_per_s=1e9)  # no time to speak of


@functools.cache
def _minilm() -> Engine:
    engine = make_engine("minilm", threads=1)
    engine.load()
    return engine


def _minilm_prompts(engine) -> list[list[int]]:
    return [[101, 7592, 102], [101, 7592, 1010, 2088, 999, 102], [101, 2088, 999, 102]]


def _smollm2_prompts(engine) -> list[list[int]]:
    from tokenizers import Tokenizer

    from gpu.engines.transformers import smollm2_tokenizer_path

    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_path()))
    texts = ["The capital of France is", "Once upon a time, there", "1, 2, 3, 4,"]
    return [tokenizer.encode(t).ids for t in texts]


def _vllm(runner: str) -> Engine:
    require_vllm_host()  # skips (or with FABRIC_EXPECT_VLLM=1 fails) with the reason
    return started(runner)


def _vllm_prompts(engine) -> list[list[int]]:
    tokenizer = engine._llm.get_tokenizer()
    texts = ["The capital of France is", "Once upon a time, there", "1, 2, 3, 4,"]
    return [tokenizer.encode(t) for t in texts]


def _openai() -> Engine:
    return shared_upstream()[1]


def _openai_prompts(engine) -> list[list[int]]:
    texts = ["w11 w12 w13 w14 w15", "w21 w22", "w31 w32 w33 w34"]
    return [engine._tokenizer.encode(t).ids for t in texts]


def _no_limit(engine) -> None:
    return None


CONTRACTS = [
    Contract("echo", "echo", _echo, lambda e: [[5, 6], [7, 8, 9, 10], [11, 12, 13]],
             frozenset({EMBED, GENERATE}), None, _no_limit, IGNORES),
    Contract("simulated", "simulated", _simulated, lambda e: [[5, 6], [7, 8, 9, 10], [11, 12, 13]],
             frozenset({EMBED, GENERATE}), None, _no_limit, IGNORES),
    Contract("minilm", "minilm", _minilm, _minilm_prompts, frozenset({EMBED}), 30_522,
             lambda e: 512, REFUSES),
    Contract("transformers", "transformers", loaded_engine, _smollm2_prompts,
             frozenset({GENERATE}), 49_152, lambda e: e.context_tokens, FOLLOWS,
             decode=lambda e: e._decode, logprobs=True, marks=tuple(MODEL_MARKS)),
    Contract("vllm-generate", "vllm", functools.partial(_vllm, "generate"), _vllm_prompts,
             frozenset({GENERATE}), None, lambda e: e.context_tokens, FOLLOWS,
             decode=lambda e: e._decode, logprobs=True, invariant=False, marks=VLLM_MARKS),
    Contract("vllm-pooling", "vllm", functools.partial(_vllm, "pooling"), _vllm_prompts,
             frozenset({EMBED}), None, lambda e: e.context_tokens, REFUSES,
             invariant=False, marks=VLLM_MARKS),
    Contract("openai", "openai", _openai, _openai_prompts, frozenset({EMBED, GENERATE}), 1001,
             lambda e: SHARED_CONTEXT_TOKENS, FOLLOWS, decode=lambda e: e._tokenizer.decode),
]  # fmt: skip
PARAMS = [c.param() for c in CONTRACTS]


# ---- helpers ----------------------------------------------------------------------------------
def batch_of(ids: list[list[int]], task: str, lane: int = 32, max_tokens: int = 4, **shape):
    """A zero-padded [n, lane] batch, a read-only non-contiguous view as the worker passes it."""
    slots = np.zeros((len(ids), SLOT_HEADER_WORDS + lane), np.uint32)
    slots[:, :SLOT_HEADER_WORDS] = 0xFFFFFFFF
    for row, item in enumerate(ids):
        slots[row, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + len(item)] = item
    tokens = slots[:, SLOT_HEADER_WORDS:]
    tokens.flags.writeable = False  # an engine reads its input, never writes it
    lengths = np.array([len(item) for item in ids], np.uint32)
    return EngineBatch(task, tokens, lengths, max_tokens, shape)


def outputs(result) -> list[list[int]]:
    o = result.offsets
    return [result.tokens[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]


def vocab_of(contract: Contract, engine) -> int | None:
    return (
        contract.vocab_size
        if contract.vocab_size is not None
        else getattr(engine, "vocab_size", None) or None
    )


def assert_well_formed(result, batch: EngineBatch) -> None:
    """The result's arrays as base.py says (types, shapes, order), whatever the items gave."""
    n = len(batch.lengths)
    assert isinstance(result.errors, list) and len(result.errors) == n
    assert all(e is None or (isinstance(e, str) and e) for e in result.errors), result.errors
    if result.embeddings is not None:  # (a refused batch's errors may come in either form)
        assert result.embeddings.dtype == np.float32
        assert result.embeddings.ndim == 2 and result.embeddings.shape[0] == n
        assert np.isfinite(result.embeddings).all()
        for i, error in enumerate(result.errors):
            if error is not None:
                assert not result.embeddings[i].any(), f"item {i} errored but has a vector"
        return
    assert result.tokens.dtype == np.uint32 and result.tokens.ndim == 1
    assert result.offsets.dtype == np.int64 and result.offsets.shape == (n + 1,)
    sizes = np.diff(result.offsets)
    assert result.offsets[0] == 0 and (sizes >= 0).all()
    assert result.offsets[-1] == len(result.tokens)
    assert (sizes <= batch.max_tokens).all(), (sizes, batch.max_tokens)
    for i, error in enumerate(result.errors):
        assert error is None or sizes[i] == 0, f"item {i} errored but has tokens"
    top = batch.shape.get("top_logprobs")
    if top is None:
        assert result.logprobs is None and result.top_ids is None
        return
    total = len(result.tokens)
    assert result.logprobs.dtype == np.float32 and result.logprobs.shape == (total,)
    assert result.top_ids.dtype == np.uint32 and result.top_ids.shape == (total, top)
    assert result.top_logprobs.dtype == np.float32 and result.top_logprobs.shape == (total, top)


def assert_refused(result, batch: EngineBatch) -> None:
    """A batch of a task the engine does not serve: one and the same error for every item."""
    assert_well_formed(result, batch)
    assert len(set(result.errors)) == 1 and result.errors[0], result.errors
    assert "only" in result.errors[0] and repr(batch.task) in result.errors[0]


def assert_same_outputs(a, b, contract: Contract) -> None:
    assert a.errors == b.errors
    if a.embeddings is not None:
        tolerance = 1e-5 if contract.invariant else 1e-2
        np.testing.assert_allclose(a.embeddings, b.embeddings, atol=tolerance)
    elif contract.invariant:
        assert outputs(a) == outputs(b)
    else:  # the same number of items, each within its budget (checked by assert_well_formed)
        assert len(outputs(a)) == len(outputs(b))


def served(contract: Contract) -> list[str]:
    return sorted(contract.tasks)


# ---- the tests --------------------------------------------------------------------------------
def test_every_registered_engine_has_a_contract_entry():
    covered = {c.engine for c in CONTRACTS}
    missing = sorted(set(ENGINES) - covered)
    assert not missing, (
        f"engine(s) {missing} are registered (gpu/engines/registry.py) but have no entry in "
        "tests/test_engine_contract.py CONTRACTS: add one (what it serves, a factory that "
        "loads it cheaply) so that the contract suite runs it"
    )
    assert covered <= set(ENGINES), sorted(covered - set(ENGINES))


@pytest.mark.parametrize("contract", PARAMS)
def test_shapes_in_and_out(contract):
    engine = contract.load()
    prompts = contract.prompts(engine)
    for task in (EMBED, GENERATE):
        batch = batch_of(prompts, task, lane=32, max_tokens=3)
        result = engine.run(batch)
        if task not in contract.tasks:
            assert_refused(result, batch)
            continue
        assert_well_formed(result, batch)
        assert result.errors == [None] * len(prompts)
        if task == EMBED:
            assert result.embeddings is not None and result.embeddings.shape[1] > 0
        else:
            assert result.embeddings is None and result.tokens is not None
        one = engine.run(batch_of(prompts[:1], task, lane=32, max_tokens=3))
        assert_well_formed(one, batch_of(prompts[:1], task, lane=32, max_tokens=3))


@pytest.mark.parametrize("contract", PARAMS)
def test_bad_items_get_their_own_errors_and_the_rest_run_as_alone(contract):
    engine = contract.load()
    good = contract.prompts(engine)[0]
    vocab = vocab_of(contract, engine)
    longest = contract.longest(engine)
    for task in served(contract):
        budget = 2 if task == GENERATE else 0
        lane = len(good) + 1
        ids = [[], good, list(good), [*good[:1], 2**32 - 1]]
        expect = ["no tokens", None, "lane holds", None if vocab is None else "vocabulary"]
        batch = batch_of(ids, task, lane=lane, max_tokens=budget)
        batch.lengths[2] = lane + 1  # says more tokens than its lane holds
        check_items(engine, batch, expect, contract)
        if longest is not None and longest < 4096:  # a prompt past the limit, in a wide lane
            wide = batch_of([good, [good[0]] * (longest + 1)], task, longest + 8, budget)
            check_items(engine, wide, [None, "tokens"], contract)
        if task == GENERATE and longest is not None:  # prompt + max_tokens past the context
            too_long = engine.run(batch_of([good], task, lane=lane, max_tokens=longest))
            assert "context" in too_long.errors[0], too_long.errors
        if vocab is None:  # no vocabulary: the largest id is served like any other
            assert check_items(engine, batch_of([[2**32 - 1]], task), [None], contract)


def check_items(engine, batch: EngineBatch, expect: list[str | None], contract: Contract):
    """Item i's error contains expect[i] (None: no error), and each good item's output is its
    output alone. Returns the result."""
    result = engine.run(batch)
    assert_well_formed(result, batch)
    for i, (error, want) in enumerate(zip(result.errors, expect, strict=True)):
        if want is None:
            assert error is None, (i, error)
            alone = engine.run(
                batch_of([batch.tokens[i, : batch.lengths[i]].tolist()], batch.task,
                         batch.tokens.shape[1], batch.max_tokens)
            )  # fmt: skip
            assert_same_outputs(piece_of(result, i), alone, contract)
        else:
            assert error is not None and want in error, (i, error, want)
    return result


def piece_of(result, i: int):
    """Item i's outcome of `result`, as a result of one item."""
    from gpu.engines.base import EngineResult

    if result.embeddings is not None:
        return EngineResult([result.errors[i]], embeddings=result.embeddings[i : i + 1])
    a, b = result.offsets[i], result.offsets[i + 1]
    return EngineResult(
        [result.errors[i]], tokens=result.tokens[a:b], offsets=np.array([0, b - a], np.int64)
    )


@pytest.mark.parametrize("contract", PARAMS)
def test_max_tokens_bounds_every_output(contract):
    engine = contract.load()
    prompts = contract.prompts(engine)
    if GENERATE not in contract.tasks:  # an embed-only engine refuses any generation
        assert_refused(engine.run(batch := batch_of(prompts, GENERATE, max_tokens=3)), batch)
        return
    long = engine.run(batch_of(prompts, GENERATE, max_tokens=6))
    for budget in (1, 3):
        batch = batch_of(prompts, GENERATE, max_tokens=budget)
        short = engine.run(batch)
        assert_well_formed(short, batch)
        if contract.invariant:
            assert outputs(short) == [o[:budget] for o in outputs(long)]


@pytest.mark.parametrize("contract", PARAMS)
def test_stop_strings(contract):
    engine = contract.load()
    prompts = contract.prompts(engine)
    if contract.shape == REFUSES:
        batch = batch_of(prompts, GENERATE, max_tokens=8, stop=["."])
        assert_refused(engine.run(batch), batch)
        return
    plain = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=8)))
    if contract.shape == IGNORES:
        stopped = engine.run(batch_of(prompts, GENERATE, max_tokens=8, stop=["a", "\n"]))
        assert outputs(stopped) == plain
        return
    decode = contract.decode(engine)
    item = max(range(len(plain)), key=lambda i: len(decode(plain[i])))
    text = decode(plain[item])
    assert len(text) >= 4, f"greedy output {text!r} is too short to cut"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=8, stop=[stop])))
    kept = decode(cut[item])
    assert stop not in kept and text.startswith(kept), (text, stop, kept)
    assert cut[item] == plain[item][: len(cut[item])]
    assert len(cut[item]) < len(plain[item])


@pytest.mark.parametrize("contract", PARAMS)
def test_seeds(contract):
    engine = contract.load()
    prompts = contract.prompts(engine)
    sampled = {"temperature": 0.9, "top_p": 0.95}
    if contract.shape == REFUSES:
        batch = batch_of(prompts, GENERATE, max_tokens=4, seed=7, **sampled)
        assert_refused(engine.run(batch), batch)
        return
    if contract.shape == IGNORES:
        plain = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=4)))
        seeded = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=4, seed=7, **sampled)))
        assert seeded == plain
        return
    first = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=6, seed=1234, **sampled)))
    again = outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=6, seed=1234, **sampled)))
    assert first == again
    if contract.invariant:
        alone = engine.run(batch_of(prompts[2:], GENERATE, max_tokens=6, seed=1234, **sampled))
        assert outputs(alone)[0] == first[2]
    seeds = {
        tuple(outputs(engine.run(batch_of(prompts, GENERATE, max_tokens=6, seed=s, **sampled)))[2])
        for s in (1, 2, 3)
    }
    assert len(seeds) > 1


class OutOfMemoryError(RuntimeError):
    """Named as torch's (what `out_of_memory` recognises by name), without importing torch."""


@pytest.mark.parametrize("contract", PARAMS)
def test_out_of_memory_splits_the_batch_until_it_fits(contract, monkeypatch):
    engine = contract.load()
    prompts = contract.prompts(engine)
    task = served(contract)[0]
    shape = {"top_logprobs": 2} if contract.logprobs else {}
    batch = batch_of([*prompts, []], task, max_tokens=3, **shape)
    whole = engine.run(batch)
    infer, seen = engine.infer, []

    def fits(rows: int):
        def limited(piece):
            seen.append(len(piece.lengths))
            if len(piece.lengths) > rows:
                raise OutOfMemoryError(f"CUDA out of memory for {len(piece.lengths)} rows")
            return infer(piece)

        return limited

    monkeypatch.setattr(engine, "infer", fits(1))
    split = engine.run(batch)
    assert seen == [4, 2, 1, 1, 2, 1, 1]  # halves until one item fits
    assert_well_formed(split, batch)
    assert_same_outputs(split, whole, contract)
    assert "no tokens" in split.errors[3]  # the empty item's own error survives the split

    monkeypatch.setattr(engine, "infer", fits(0))  # not even one item fits: the batch goes back
    with pytest.raises(TransientEngineError) as back:
        engine.run(batch)
    assert f"{engine.name} engine: out of memory for a batch of 4 x 32 tokens" in str(back.value)
    assert "one item of it alone" in str(back.value)

    def broken(piece):
        raise RuntimeError("engine core died")

    monkeypatch.setattr(engine, "infer", broken)  # anything else: the engine is broken, at once
    with pytest.raises(RuntimeError, match="engine core died"):
        engine.run(batch)


@pytest.mark.parametrize("contract", PARAMS)
def test_results_are_what_the_wire_and_completion_take(contract):
    engine = contract.load()
    prompts = contract.prompts(engine)
    shapes = [{}]
    if contract.logprobs:
        shapes.append({"top_logprobs": 2})
    for task in served(contract):
        for shape in shapes if task == GENERATE else [{}]:
            batch = batch_of([*prompts, []], task, max_tokens=3, **shape)
            result = engine.run(batch)
            items = np.zeros(len(batch.lengths), ITEM_DTYPE)
            items["slot"] = np.arange(len(items))
            arrays = results_message(items, batch.lengths, result)
            status, kind = arrays["status"], arrays["kind"]
            payload, offsets = arrays["payload"], arrays["offsets"]
            assert status.tolist() == [ResultStatus.RESULT] * 3 + [ResultStatus.ERROR]
            assert kind[3] == ResultKind.TEXT
            assert payload[offsets[3] : offsets[4]].tobytes().decode() == result.errors[3]
            endpoint = EMBEDDINGS if task == EMBED else COMPLETIONS
            want = expected_kind({"endpoint": endpoint, **shape})
            assert (kind[:3] == want).all()
            n = len(items)
            expected = Expected(
                np.full(n, want, np.uint8),
                np.full(n, 0 if task == EMBED else 3, np.int64),
                [("m", 32)],
                np.zeros(n, np.int64),
            )
            verdict = ResultCheck().check(expected, status, kind, payload, offsets)
            assert (verdict.cause == OK).all(), verdict.detail
            for i in range(3):
                words = payload[offsets[i] : offsets[i + 1]].view("<u4")
                if task == EMBED:
                    assert words.view("<f4").tolist() == result.embeddings[i].tolist()
                elif shape:
                    unpacked = token_logprobs.unpack(words)
                    assert unpacked.tokens == outputs(result)[i]
                    assert len(unpacked.top_ids) == len(unpacked.tokens)
                else:
                    assert words.tolist() == outputs(result)[i]


@pytest.mark.parametrize("contract", PARAMS)
def test_logprobs_are_given_or_refused_at_ingest(contract):
    if GENERATE not in contract.tasks:  # logprobs are asked of generation only
        engine = contract.load()
        batch = batch_of(contract.prompts(engine), GENERATE, max_tokens=4, top_logprobs=3)
        assert_refused(engine.run(batch), batch)
        return
    assert (contract.engine in LOGPROB_ENGINES) == contract.logprobs, (
        "ingest.catalog.LOGPROB_ENGINES must list exactly the engines that return log "
        "probabilities: ingest refuses such a line for the others"
    )
    if not contract.logprobs:
        return
    engine = contract.load()
    batch = batch_of(contract.prompts(engine), GENERATE, max_tokens=4, top_logprobs=3)
    result = engine.run(batch)
    assert_well_formed(result, batch)
    assert (result.logprobs <= 1e-4).all() and (result.top_logprobs <= 1e-4).all()
    assert (np.diff(result.top_logprobs, axis=1) <= 1e-5).all()  # most likely first
    assert (result.logprobs <= result.top_logprobs[:, 0] + 1e-4).all()
