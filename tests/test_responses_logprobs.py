"""/v1/responses with log probabilities: `top_logprobs` / `include`, in OpenAI's Response shape.

The request (ingest/request_shape.py) turns `top_logprobs` or `include:
["message.output_text.logprobs"]` into the shape's `top_logprobs`; an engine
without logprobs is refused per line; delivery renders
`output[0].content[0].logprobs` (collector/delivery/responses.py). Where
SmolLM2 is installed, a real broker with a transformers worker returns them
end to end, validated with the openai package's Response type.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from broker import submit
from openai.types.responses import Response
from smollm2 import needs_model
from test_dispatch_pipeline import cli
from test_token_logprobs import read, scored_result

from collector.delivery.lines import format_page
from collector.delivery.result_page import ExportContext, ResultPage
from gpu.worker.results import results_message

RESPONSES = "/v1/responses"


def responses_line(model: str = "smol", custom_id: str = "r", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": RESPONSES,
        "body": {"model": model, "input": "One, two,", **body},
    }


@pytest.mark.parametrize(
    ("body", "top"),
    [
        ({}, None),
        ({"top_logprobs": 2}, 2),
        ({"include": ["message.output_text.logprobs"]}, 0),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, 3),
        ({"include": []}, None),
    ],
)
def test_top_logprobs_and_include_become_the_shapes_top_logprobs(body, top):
    chunk = read(responses_line(**body))
    assert not chunk.errors, chunk.errors
    assert chunk.shapes[0].top_logprobs == top


@pytest.mark.parametrize(
    ("line", "code", "says"),
    [
        (
            responses_line("echoed", top_logprobs=1),
            "unsupported_parameter",
            'body.top_logprobs: model "echoed" runs on engine echo, which gives no token log '
            "probabilities",
        ),
        (
            responses_line("echoed", include=["message.output_text.logprobs"]),
            "unsupported_parameter",
            '"message.output_text.logprobs" from include',
        ),
        (
            responses_line(include=["reasoning.encrypted_content"]),
            "unsupported_parameter",
            'body.include[0] = "reasoning.encrypted_content" is not served here',
        ),
        (responses_line(include="message.output_text.logprobs"), "wrong_type", "not a list"),
        (responses_line(top_logprobs=21), "invalid_value", "body.top_logprobs = 21"),
    ],
)
def test_responses_logprobs_are_refused_per_line_where_they_cannot_be_served(line, code, says):
    [error] = read(line).errors
    assert error.code == code and says in error.message, error.message


def test_delivery_renders_the_output_texts_logprobs_in_openais_response_shape():
    message = results_message(np.zeros(2, np.uint8), np.array([4, 4]), scored_result())
    shapes = {1: {"endpoint": RESPONSES, "max_tokens": 3, "top_logprobs": 2}}
    page = ResultPage(
        index=np.array([0, 1], np.uint32),
        custom_ids=["a", "b"],
        status=message["status"],
        kind=message["kind"],
        shape=np.array([1, 1], np.uint16),
        prompt_tokens=np.array([4, 4], np.uint32),
        payload=message["payload"],
        offsets=message["offsets"],
    )
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    out, err = format_page(page, ExportContext("job", "smol", shapes, decode=decode))
    assert err == []
    response = Response.model_validate(json.loads(out[0])["response"]["body"])
    assert response.top_logprobs == 2 and response.status == "incomplete"  # 3 of 3 tokens
    [text] = response.output[0].content
    assert text.text == "<5><6><7>"
    assert [(t.token, t.logprob, t.bytes) for t in text.logprobs] == [
        ("<5>", -0.5, list(b"<5>")),
        ("<6>", -1.25, list(b"<6>")),
        ("<7>", -0.125, list(b"<7>")),
    ]
    assert [(t.token, t.logprob) for t in text.logprobs[1].top_logprobs] == [
        ("<6>", -1.25),
        ("<5>", -1.5),
    ]
    short = Response.model_validate(json.loads(out[1])["response"]["body"])
    assert short.status == "completed" and short.usage.output_tokens == 1
    assert [t.token for t in short.output[0].content[0].logprobs] == ["<8>"]


def test_logprobs_without_alternatives_pack_for_a_batch():
    """`include` alone (or chat's `logprobs: true` alone) asks for 0 alternatives per token."""
    from gpu.engines.logprobs import pack_logprobs

    item = (np.array([-0.5, -1.5], np.float32), np.zeros((2, 0), np.uint32), np.zeros((2, 0)))
    logprobs, ids, values = pack_logprobs([item, None, item], 0)
    assert logprobs.tolist() == [-0.5, -1.5, -0.5, -1.5]
    assert ids.shape == values.shape == (4, 0)


@needs_model
@pytest.mark.slow
@pytest.mark.timeout(300)  # the first model test of a session saves SmolLM2 (tests/smollm2.py)
def test_responses_logprobs_come_back_through_a_real_broker(tmp_path, smol_broker):
    b = smol_broker  # stopped, and its data dir checked, at the end of the session
    greedy = {"max_output_tokens": 3, "temperature": 0}
    lines = [
        responses_line(custom_id="top", top_logprobs=2, **greedy),
        responses_line(custom_id="inc", include=["message.output_text.logprobs"], **greedy),
        responses_line(custom_id="plain", **greedy),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert submit(b.config, path, "--job-id", "rlp").returncode == 0
    out = tmp_path / "out.jsonl"
    fetched = cli(b, "results", "rlp", "-o", str(out), "--follow", timeout_s=300)
    assert fetched.returncode == 0, fetched.stderr
    bodies = {
        r["custom_id"]: Response.model_validate(r["response"]["body"])
        for r in map(json.loads, out.read_text().splitlines())
    }
    plain = bodies["plain"].output[0].content[0]
    assert plain.logprobs == [] and bodies["plain"].top_logprobs is None
    for key, alternatives in (("top", 2), ("inc", 0)):
        response = bodies[key]
        [text] = response.output[0].content
        assert text.text == plain.text  # greedy, all three
        assert "".join(t.token for t in text.logprobs) == text.text
        assert len(text.logprobs) == response.usage.output_tokens == 3
        assert all(t.logprob <= 0 and len(t.top_logprobs) == alternatives for t in text.logprobs)
        assert response.top_logprobs == alternatives
    top = bodies["top"].output[0].content[0].logprobs
    assert all(t.top_logprobs[0].token == t.token for t in top)  # greedy: the best
