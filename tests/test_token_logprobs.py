"""Logprobs: asked per line, computed by the transformers engine, checked, stored and rendered.

Everywhere: the shape parameters and the per-line refusal for engines without
logprobs; the TOKEN_LOGPROBS payload packed by the worker, checked by
completion and rendered by delivery in OpenAI's types. Where SmolLM2 is
installed: the engine's log probabilities equal a plain forward pass of the
model over the prompt and the generated tokens, and a real broker with a
transformers worker returns them end to end.
"""

from __future__ import annotations

import io
import json

import numpy as np
import orjson
import pytest
from broker import submit
from openai.types import Completion
from openai.types.chat import ChatCompletion
from smollm2 import loaded_engine, needs_model
from test_dispatch_pipeline import cli
from test_transformers_engine import batch_of, outputs

from collector.completion.result_check import Expected, ResultCheck, expected_kind
from collector.delivery.lines import format_page
from collector.delivery.result_page import ExportContext, ResultPage
from config import load_settings
from gpu.engines.base import EngineResult
from gpu.worker.results import results_message
from ingest.batch_input import iter_batch_input
from pipeline.core import token_logprobs
from pipeline.core.result_kinds import ResultKind

CHAT = "/v1/chat/completions"
MODELS = [
    {"name": "echoed", "engine": "echo", "tokenizer": "tokenizer.json"},
    {"name": "smol", "engine": "transformers", "tokenizer": "tokenizer.json"},
]


def read(line: dict):
    settings = load_settings(None, {"models": MODELS})
    [chunk] = iter_batch_input(io.BytesIO(orjson.dumps(line) + b"\n"), settings)
    return chunk


def chat_line(model="smol", **body):
    messages = [{"role": "user", "content": "hi"}]
    return {
        "custom_id": "c",
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": messages, **body},
    }


@pytest.mark.parametrize(
    ("body", "top"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 3}, 3),
    ],
)
def test_chat_logprobs_become_the_shapes_top_logprobs(body, top):
    chunk = read(chat_line(**body))
    assert not chunk.errors
    assert chunk.shapes[0].top_logprobs == top
    assert ("top_logprobs" in chunk.shapes[0].as_dict()) == (top is not None)


@pytest.mark.parametrize(
    ("line", "code", "says"),
    [
        (
            chat_line("echoed", logprobs=True),
            "unsupported_parameter",
            'model "echoed" runs on engine echo, which gives no token log probabilities',
        ),
        (
            chat_line(logprobs=False, top_logprobs=2),
            "conflicting_fields",
            "top_logprobs with logprobs = false",
        ),
        (chat_line(logprobs=True, top_logprobs=21), "invalid_value", "body.top_logprobs = 21"),
        (chat_line(logprobs=1), "wrong_type", "body.logprobs = 1 is not a boolean"),
        (
            {
                "custom_id": "p",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "smol", "prompt": "x", "logprobs": 6},
            },
            "invalid_value",
            "body.logprobs = 6",
        ),
    ],
)
def test_logprobs_are_refused_per_line_where_they_cannot_be_served(line, code, says):
    [error] = read(line).errors
    assert error.code == code and says in error.message, error.message


def test_completions_logprobs_is_the_number_of_alternatives():
    line = {
        "custom_id": "p",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "smol", "prompt": "x", "logprobs": 2},
    }
    assert read(line).shapes[0].top_logprobs == 2


def scored_result() -> EngineResult:
    """Two items: 3 tokens and 1 token, 2 alternatives each."""
    return EngineResult(
        [None, None],
        tokens=np.array([5, 6, 7, 8], np.uint32),
        offsets=np.array([0, 3, 4]),
        logprobs=np.array([-0.5, -1.25, -0.125, -2.0], np.float32),
        top_ids=np.array([[5, 9], [6, 5], [7, 1], [3, 8]], np.uint32),
        top_logprobs=np.array(
            [[-0.5, -1.0], [-1.25, -1.5], [-0.125, -3.0], [-1.0, -2.0]], np.float32
        ),
    )


def test_the_payload_packs_and_unpacks_and_completion_checks_it_against_its_header():
    message = results_message(np.zeros(2, np.uint8), np.array([4, 4]), scored_result())
    assert message["kind"].tolist() == [ResultKind.TOKEN_LOGPROBS] * 2
    payload, offsets = message["payload"], message["offsets"]
    assert np.diff(offsets).tolist() == [
        4 * token_logprobs.payload_words(3, 2),
        4 * token_logprobs.payload_words(1, 2),
    ]
    first = token_logprobs.unpack(payload[offsets[0] : offsets[1]].view("<u4"))
    assert (first.tokens, first.logprobs, first.top_ids) == (
        [5, 6, 7],
        [-0.5, -1.25, -0.125],
        [[5, 9], [6, 5], [7, 1]],
    )
    assert expected_kind({"endpoint": CHAT, "top_logprobs": 2}) == ResultKind.TOKEN_LOGPROBS
    expected = Expected(
        np.full(2, ResultKind.TOKEN_LOGPROBS, np.uint8), np.array([3, 3]), [], np.full(2, -1)
    )
    verdict = ResultCheck().check(expected, message["status"], message["kind"], payload, offsets)
    assert verdict.cause.tolist() == [0, 0]
    lying = payload.copy()
    lying[0] = 2  # the header says 2 tokens where 3 are packed
    verdict = ResultCheck().check(expected, message["status"], message["kind"], lying, offsets)
    assert verdict.cause.tolist() == [3, 0]  # WRONG_SIZE
    tight = Expected(expected.kind, np.array([2, 2]), [], expected.dim_of)
    verdict = ResultCheck().check(tight, message["status"], message["kind"], payload, offsets)
    assert verdict.cause.tolist() == [3, 0]  # more tokens than max_tokens


def test_delivery_renders_openais_logprobs_for_chat_and_completions():
    message = results_message(np.zeros(2, np.uint8), np.array([4, 4]), scored_result())
    shapes = {
        1: {"endpoint": CHAT, "max_tokens": 3, "top_logprobs": 2},
        2: {"endpoint": "/v1/completions", "max_tokens": 8, "top_logprobs": 2},
    }
    page = ResultPage(
        index=np.array([0, 1], np.uint32),
        custom_ids=["a", "b"],
        status=message["status"],
        kind=message["kind"],
        shape=np.array([1, 2], np.uint16),
        prompt_tokens=np.array([4, 4], np.uint32),
        payload=message["payload"],
        offsets=message["offsets"],
    )
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    out, err = format_page(page, ExportContext("job", "smol", shapes, decode=decode))
    assert err == []
    chat = ChatCompletion.model_validate(json.loads(out[0])["response"]["body"])
    assert (
        chat.choices[0].message.content == "<5><6><7>" and chat.choices[0].finish_reason == "length"
    )
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("<5>", -0.5, list(b"<5>")),
        ("<6>", -1.25, list(b"<6>")),
        ("<7>", -0.125, list(b"<7>")),
    ]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [
        ("<6>", -1.25),
        ("<5>", -1.5),
    ]
    completion = Completion.model_validate(json.loads(out[1])["response"]["body"])
    logprobs = completion.choices[0].logprobs
    assert (logprobs.tokens, logprobs.token_logprobs, logprobs.text_offset) == (
        ["<8>"],
        [-2.0],
        [0],
    )
    assert logprobs.top_logprobs == [{"<3>": -1.0, "<8>": -2.0}]
    assert completion.usage.completion_tokens == 1


@needs_model
@pytest.mark.timeout(300)  # the first model test of a process loads SmolLM2 (tests/smollm2.py)
def test_the_engines_logprobs_are_the_models_own():
    import torch
    from tokenizers import Tokenizer

    from gpu.engines.transformers import smollm2_tokenizer_path

    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_path()))
    engine = loaded_engine()
    prompts = [tokenizer.encode("The capital of France is").ids, tokenizer.encode("One, two,").ids]
    for shape in ({"top_logprobs": 3}, {"top_logprobs": 2, "temperature": 1.0, "seed": 5}):
        result = engine.run(batch_of(prompts, lane=32, max_tokens=5, **shape))
        generated = outputs(result)
        assert result.top_ids.shape == (sum(map(len, generated)), shape["top_logprobs"])
        at = 0
        for prompt, tokens in zip(prompts, generated, strict=True):
            with torch.inference_mode():
                logits = engine._model(torch.tensor([prompt + tokens])).logits[0].float()
            plain = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
            mine = slice(at, at + len(tokens))
            want = plain[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
            assert np.allclose(result.logprobs[mine], want, atol=1e-4)
            best = plain.topk(shape["top_logprobs"], dim=-1)
            assert (result.top_ids[mine] == best.indices.numpy()).all()
            assert np.allclose(result.top_logprobs[mine], best.values.numpy(), atol=1e-4)
            at += len(tokens)
        if "temperature" not in shape:  # greedy: each token is the most likely one
            assert (result.top_ids[:, 0] == result.tokens).all()


@needs_model
@pytest.mark.slow
@pytest.mark.timeout(300)  # the first model test of a session saves SmolLM2 (tests/smollm2.py)
def test_logprobs_come_back_through_a_real_broker(tmp_path, smol_broker):
    b = smol_broker  # stopped, and its data dir checked, at the end of the session
    lines = [
        chat_line(logprobs=True, top_logprobs=2, max_tokens=4, temperature=0) | {"custom_id": "c"},
        {
            "custom_id": "p",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "smol", "prompt": "One, two,", "logprobs": 1, "max_tokens": 3},
        },
        chat_line(max_tokens=4, temperature=0) | {"custom_id": "plain"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    assert submit(b.config, path, "--job-id", "lp").returncode == 0
    out = tmp_path / "out.jsonl"
    fetched = cli(b, "results", "lp", "-o", str(out), "--follow", timeout_s=300)
    assert fetched.returncode == 0, fetched.stderr
    bodies = {
        r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())
    }
    chat = ChatCompletion.model_validate(bodies["c"])
    plain = ChatCompletion.model_validate(bodies["plain"])
    assert plain.choices[0].logprobs is None
    assert chat.choices[0].message.content == plain.choices[0].message.content  # greedy both
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy: the best
    completion = Completion.model_validate(bodies["p"])
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens == 3
    status = json.loads(cli(b, "status", "lp", "--json").stdout)
    assert status["usage"]["completion_tokens"] == sum(
        body["usage"]["completion_tokens"] for body in bodies.values()
    )


def test_the_vllm_engine_turns_vllms_logprobs_into_the_same_arrays(monkeypatch):
    from dataclasses import dataclass
    from types import SimpleNamespace

    from test_vllm_engine import FakeLLM, FakeParams

    import gpu.engines.vllm as ve

    @dataclass
    class Params(FakeParams):
        logprobs: int | None = None

    def step(chosen: int, ranked: list[tuple[int, float]]) -> dict:
        found = {t: SimpleNamespace(logprob=v, rank=r + 1) for r, (t, v) in enumerate(ranked)}
        found.setdefault(chosen, SimpleNamespace(logprob=-5.0, rank=9))  # sampled, not in top
        return found

    class Scored(FakeLLM):
        def generate(self, prompts, params, use_tqdm):
            self.sent.append((prompts, params))
            steps = [
                step(7, [(7, -0.1), (3, -2.5)]),
                step(8, [(4, -0.2), (6, -1.0)]),
                step(2, [(2, -0.3), (1, -4.0)]),
            ]
            done = SimpleNamespace(
                token_ids=[7, 8, 2], finish_reason="stop", stop_reason=None, logprobs=steps
            )
            return [SimpleNamespace(outputs=[done]) for _ in prompts]

    monkeypatch.setattr(ve, "vllm_installed", lambda: True)
    engine = ve.VllmEngine(model="stand-in")
    llm = Scored()
    engine.attach(llm, Params)
    result = engine.run(batch_of([[1, 2]], lane=4, max_tokens=3, top_logprobs=2))
    assert llm.sent[-1][1].logprobs == 2
    assert outputs(result) == [[7, 8]]  # the EOS goes, and its logprob with it
    assert result.logprobs.tolist() == pytest.approx([-0.1, -5.0])
    assert result.top_ids.tolist() == [[7, 3], [4, 6]]
    assert np.allclose(result.top_logprobs, [[-0.1, -2.5], [-0.2, -1.0]])
    plain = engine.run(batch_of([[1, 2]], lane=4, max_tokens=3))
    assert plain.logprobs is None and llm.sent[-1][1].logprobs is None
