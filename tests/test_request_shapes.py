"""Request shapes through a real broker, checked with the official openai package's types.

One job of mixed lines (embeddings as floats and as base64, chat with content
parts, completions, /v1/responses, and lines refused per line) through real
broker processes and local workers (`echo` for generation, `simulated` for
embeddings); the output lines are validated with `openai.types`, and
`status JOB` carries the job's token totals, each result counted once.
"""

from __future__ import annotations

import io
import json

import numpy as np
import orjson
import pytest
from broker import Broker, submit, write_config
from conftest import assert_check_clean
from test_dispatch_pipeline import cli

from pipeline.core import exitcodes

openai = pytest.importorskip("openai")
from openai._models import construct_type  # noqa: E402
from openai.lib._parsing._embeddings import parse_embedding_response  # noqa: E402
from openai.types import Completion, CreateEmbeddingResponse  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.responses import Response  # noqa: E402

WORKERS = """
[[models]]
name = "gen"
engine = "echo"
tokenizer = "{tokenizer}"
max_tokens = 64
[[workers]]
model = "gen"
batch_items = 64
target_batch_s = 0
[[workers]]
model = "sim"
simulated_tokens_per_s = 5e6
batch_items = 64
target_batch_s = 0
"""


def shapes_config(tmp_path):
    config = write_config(tmp_path, workers=0)
    text = config.read_text().replace("[workers]\nlocal = 0\n", "")
    config.write_text(text + WORKERS.format(tokenizer=tmp_path / "tokenizer.json"))
    return config


def line(custom_id: str, url: str, **body) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


CHAT = "/v1/chat/completions"
PARTS = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
LINES = [
    line("e-float", "/v1/embeddings", model="sim", input="w1 w2 w3"),
    line("e-b64", "/v1/embeddings", model="sim", input="w1 w2 w3", encoding_format="base64"),
    line("e-bad", "/v1/embeddings", model="sim", input="w1", encoding_format="int8"),
    line("c-parts", CHAT, model="gen", messages=[{"role": "user", "content": PARTS}]),
    line("c-string", CHAT, model="gen", messages=[{"role": "user", "content": "w1 w2\nw3"}]),
    line(
        "c-image",
        CHAT,
        model="gen",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ),
    line(
        "c-logprobs", CHAT, model="gen", messages=[{"role": "user", "content": "w1"}], logprobs=True
    ),
    line("p", "/v1/completions", model="gen", prompt="w4 w5", max_tokens=64),
    line(
        "r-cut", "/v1/responses", model="gen", input="w6 w7", instructions="w8", max_output_tokens=3
    ),
    line(
        "r-msgs",
        "/v1/responses",
        model="gen",
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w9"}]}
        ],
        temperature=0,
    ),
]
REFUSED = {
    "e-bad": "invalid_value",
    "c-image": "unsupported_content",
    "c-logprobs": "unsupported_parameter",
}


def test_every_shape_comes_back_in_openais_types_and_the_job_counts_its_tokens(tmp_path):
    b = Broker(shapes_config(tmp_path)).start()
    try:
        path = tmp_path / "in.jsonl"
        path.write_bytes(b"\n".join(LINES) + b"\n")
        done = submit(b.config, path, "--job-id", "shapes")
        assert done.returncode == 0, done.stderr
        out = tmp_path / "out.jsonl"
        fetched = cli(b, "results", "shapes", "-o", str(out), "--follow", timeout_s=120)
        assert fetched.returncode == 0, fetched.stderr
        got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
        errors = {
            r["custom_id"]: r["error"]
            for r in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())
        }
        assert {k: e["code"] for k, e in errors.items()} == REFUSED
        assert 'model "gen" takes text only' in errors["c-image"]["message"]
        bodies = {k: r["response"]["body"] for k, r in got.items()}
        assert set(bodies) == {"e-float", "e-b64", "c-parts", "c-string", "p", "r-cut", "r-msgs"}

        # base64: what the openai package decodes is the float output, bit for bit
        floats = CreateEmbeddingResponse.model_validate(bodies["e-float"])
        packed = construct_type(type_=CreateEmbeddingResponse, value=bodies["e-b64"])
        assert isinstance(packed.data[0].embedding, str)
        decoded = parse_embedding_response(packed, encoding_format=openai.NOT_GIVEN)
        as_float = np.array(floats.data[0].embedding, np.float32)
        assert len(as_float) == 384
        assert np.array_equal(np.array(decoded.data[0].embedding, np.float32), as_float)
        assert floats.usage.prompt_tokens == floats.usage.total_tokens == 3

        # content parts are the joined string: the same prompt, the same answer
        parts, string = (ChatCompletion.model_validate(bodies[k]) for k in ("c-parts", "c-string"))
        assert parts.choices[0].message.content == string.choices[0].message.content
        assert "w1 w2 w3" in parts.choices[0].message.content
        assert parts.usage.prompt_tokens == string.usage.prompt_tokens
        completion = Completion.model_validate(bodies["p"])
        assert completion.choices[0].text == "w4 w5"
        assert completion.usage.total_tokens == 4

        cut, whole = (Response.model_validate(bodies[k]) for k in ("r-cut", "r-msgs"))
        assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert cut.usage.output_tokens == 3 and cut.max_output_tokens == 3
        assert (whole.status, whole.output[0].type, whole.output[0].role) == (
            "completed",
            "message",
            "assistant",
        )
        assert "w9" in whole.output_text
        assert cut.usage.input_tokens > whole.usage.input_tokens  # instructions: a message more
        assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

        prompt = sum(
            u.get("prompt_tokens", u.get("input_tokens", 0))
            for u in (body["usage"] for body in bodies.values())
        )
        generated = sum(
            u.get("completion_tokens", u.get("output_tokens", 0))
            for u in (body["usage"] for body in bodies.values())
        )
        status = cli(b, "status", "shapes", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }
        assert "generated" in cli(b, "status", "shapes").stdout
        assert b.stop() == exitcodes.OK
    finally:
        b.close()
    assert_check_clean(b.data_dir)


# ---- the same, without a broker ---------------------------------------------------------------
def parsed(url: str, **body):
    from test_input_format import SETTINGS

    from ingest.batch_input import iter_batch_input

    data = line("x", url, model="chat", **body) + b"\n"
    [chunk] = iter_batch_input(io.BytesIO(data), SETTINGS)
    return chunk


def test_content_parts_are_the_joined_string_and_responses_input_is_messages():
    chunk = parsed(CHAT, messages=[{"role": "user", "content": PARTS}])
    assert not chunk.errors and chunk.texts[0] == (("user", "w1 w2\nw3"),)
    chunk = parsed("/v1/responses", input="hi", instructions="be terse", max_output_tokens=9)
    assert chunk.texts[0] == (("system", "be terse"), ("user", "hi"))
    assert (chunk.shapes[0].endpoint, chunk.shapes[0].max_tokens) == ("/v1/responses", 9)
    messages = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    ]
    chunk = parsed("/v1/responses", input=[*messages, {"role": "user", "content": "b"}])
    assert chunk.texts[0] == (("assistant", "a"), ("user", "b"))
    [error] = parsed(
        "/v1/responses", input=[{"type": "function_call_output", "output": "x"}]
    ).errors
    assert error.code == "unsupported_content"


def test_new_shape_fields_leave_old_shapes_as_they_were():
    from ingest.request_shape import parse_shape

    old = {
        "endpoint": "/v1/embeddings",
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "seed": None,
        "stop": [],
        "priority": 0,
    }
    assert parse_shape(old, "/v1/embeddings").as_dict() == old  # same dict, same shape id
    assert (
        parse_shape({"encoding_format": "base64"}, "/v1/embeddings").as_dict()["encoding_format"]
        == "base64"
    )
    assert "top_logprobs" not in parse_shape({}, CHAT).as_dict()
