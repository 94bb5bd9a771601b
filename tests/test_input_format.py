"""OpenAI Batch input: good lines to numpy chunks, every bad-line code, strict mode, streaming."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import orjson
import pytest
from conftest import fuzz_examples
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from config import load_settings
from ingest import custom_ids
from ingest.batch_input import iter_batch_input
from ingest.custom_ids import CustomIdSet
from ingest.jsonl_lines import numbered_lines
from ingest.line_errors import CODES, LineError
from ingest.request_shape import Shape
from pipeline.core.errors import IngestError, InputLineError

DATA = Path(__file__).parent / "data"
MODELS = [
    {"name": "embedder", "engine": "minilm", "tokenizer": "tokenizer.json"},
    {"name": "chat", "engine": "echo", "tokenizer": "tokenizer.json", "max_tokens": 8},
    {"name": "ids-only", "engine": "vllm"},
]
SETTINGS = load_settings(None, {"models": MODELS})


def parse(data: bytes, **kwargs):
    return list(iter_batch_input(io.BytesIO(data), SETTINGS, **kwargs))


def request(custom_id="r", url="/v1/completions", **body) -> dict:
    body.setdefault("model", "chat")
    if not {"prompt", "input", "messages", "prompt_token_ids"} & body.keys():
        body["prompt"] = "hello"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def test_good_file_of_mixed_endpoints_parses_to_columns_and_shapes():
    [chunk] = list(iter_batch_input(DATA / "batch_good.jsonl", SETTINGS))
    assert chunk.errors == ()
    assert (chunk.first_line, chunk.last_line) == (1, 8)
    assert chunk.line.dtype == np.uint64 and chunk.line.tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert chunk.custom_ids == ("emb-1", "emb-2", "chat-1", "chat-2", "cmpl-1", "cmpl-2", "cmpl-3")
    assert chunk.models == ("embedder", "chat", "ids-only")
    assert chunk.model_index.tolist() == [0, 0, 1, 1, 1, 2, 2]
    embed = Shape("/v1/embeddings", None, None, None, None, (), 0)
    chat = Shape("/v1/chat/completions", 64, 0.0, 1.0, None, (), 0)
    cmpl = Shape("/v1/completions", 256, 1.0, 0.9, 7, ("\n\n", "THE END"), 0)
    cmpl_p9 = Shape("/v1/completions", 256, 1.0, 1.0, None, (), 9)
    embed_p3 = Shape("/v1/embeddings", None, None, None, None, (), 3)
    assert chunk.shapes == (embed, embed_p3, chat, cmpl, cmpl_p9)
    # temperature 0 and 0.0, max_tokens and max_completion_tokens, stop order and repeats: one shape
    assert chunk.shape_index.tolist() == [0, 1, 2, 2, 3, 3, 4]
    assert chunk.shapes[3].task == "generate" and chunk.shapes[0].task == "embed"
    assert chunk.shapes[3].as_dict()["stop"] == ["\n\n", "THE END"]
    assert chunk.tokens.dtype == np.uint32 and chunk.offsets.dtype == np.int64
    assert chunk.offsets.tolist() == [0, 0, 3, 3, 3, 3, 6, 7]
    assert chunk.tokens.tolist() == [101, 2023, 102, 0, 4294967295, 17, 5]
    assert chunk.lengths.tolist() == [0, 3, 0, 0, 0, 3, 1]
    assert chunk.text_items.tolist() == [0, 2, 3, 4]
    assert chunk.texts == (
        "The log is the queue.",
        (("system", "You are terse."), ("user", "Name a prime.")),
        (("user", "Hello"),),
        "Once upon a time",
    )
    assert chunk.needs_tokenizing


BAD_FILE_ERRORS = [  # (line, custom_id, code) of tests/data/batch_bad.jsonl
    (2, None, "invalid_json"),
    (3, None, "not_an_object"),
    (4, None, "missing_field"),
    (5, None, "wrong_type"),
    (6, "bad-priority", "invalid_value"),
    (7, "bad-param", "unsupported_parameter"),
    (8, "both", "conflicting_fields"),
    (9, "get", "wrong_method"),
    (10, "speech", "unknown_url"),
    (11, "gpt", "unknown_model"),
    (12, "emb-chat", "endpoint_not_served"),
    (13, "text-to-ids", "text_not_accepted"),
    (14, "ok-1", "duplicate_custom_id"),
    (15, "empty", "empty_prompt"),
    (16, "big-id", "token_out_of_range"),
    (17, "long", "prompt_too_long"),
]


def test_bad_file_gives_one_record_per_bad_line_and_keeps_the_good_ones():
    [chunk] = list(iter_batch_input(DATA / "batch_bad.jsonl", SETTINGS))
    assert [(e.line, e.custom_id, e.code) for e in chunk.errors] == BAD_FILE_ERRORS
    assert chunk.custom_ids == ("ok-1", "ok-2")
    assert chunk.line.tolist() == [1, 18]
    for error in chunk.errors:
        assert error.message.startswith(f"line {error.line}")
        assert error.code in CODES


UNKNOWN_MODEL_MESSAGE = "known models: chat, embedder, ids-only"
BAD_LINES = [
    # (line, code, a piece of the message)
    (b'{"custom_id": "x",', "invalid_json", "not valid JSON"),
    (b"\xff\xfe{}", "invalid_json", "not valid UTF-8: byte 1 (0xff): invalid start byte"),
    (
        b'{"custom_id": "a\xed\xa0\x80"}',
        "invalid_json",
        "not valid UTF-8: byte 17 (0xed): invalid continuation byte",
    ),
    (b"[" * 1100 + b"]" * 1100, "nesting_too_deep", "at character 1025"),
    (b'{"a": 1} {"b": 2}', "invalid_json", "after document"),
    (b"[1, 2]", "not_an_object", "the line is a list, not an object"),
    (b"42", "not_an_object", "the line is a number"),
    (
        {"method": "POST", "url": "/v1/completions", "body": {}},
        "missing_field",
        "custom_id is missing",
    ),
    (
        {"custom_id": "x", "url": "/v1/completions", "body": {}},
        "missing_field",
        "method is missing",
    ),
    ({"custom_id": "x", "method": "POST", "body": {}}, "missing_field", "url is missing"),
    (
        {"custom_id": "x", "method": "POST", "url": "/v1/completions"},
        "missing_field",
        "body is missing",
    ),
    (request(model=None) | {"body": {"prompt": "x"}}, "missing_field", "body.model is missing"),
    (request(prompt=None), "missing_field", "neither prompt nor prompt_token_ids"),
    (
        request(url="/v1/chat/completions", messages=[{"role": "user"}]),
        "missing_field",
        "body.messages[0].content is missing",
    ),
    (
        {"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {}},
        "wrong_type",
        "custom_id = 5 is a number",
    ),
    (request() | {"body": ["x"]}, "wrong_type", "body = "),
    (request(model=3), "wrong_type", "body.model = 3"),
    (
        request(url="/v1/embeddings", model="embedder", input=["a", 3]),
        "wrong_type",
        "body.input[1] = 3 is a number; a list of strings holds only strings",
    ),
    (
        request(url="/v1/embeddings", model="embedder", input=[[101], "a"]),
        "wrong_type",
        'body.input[1] = "a" is a string; a list of token-id lists holds only lists',
    ),
    (request(url="/v1/embeddings", model="embedder", input=[]), "empty_prompt", "empty list"),
    (request(prompt=["a", ""]), "empty_prompt", "body.prompt[1] is an empty string"),
    (
        request(url="/v1/embeddings", model="embedder", input=["a"] * 2049),
        "too_many_inputs",
        "body.input has 2049 inputs; at most 2048 per line",
    ),
    (request(prompt=["a"] * 40, n=60), "too_many_inputs", "2400 results (40 prompts x n = 60)"),
    (request(n=0), "invalid_value", "body.n = 0 is out of range; set an integer 1..128"),
    (request(n=129), "invalid_value", "body.n = 129 is out of range"),
    (request(n=2.0), "wrong_type", "body.n = 2.0 is a number"),
    (
        request(url="/v1/embeddings", model="embedder", input=[[101, 102], [101, 30522]]),
        "token_out_of_range",
        'body.input[1][1] = 30522 is beyond the vocabulary of model "embedder"',
    ),
    (request(prompt=[[1, 2], list(range(9))]), "prompt_too_long", "body.prompt[1] has 9 tokens"),
    (request(prompt=7), "wrong_type", "body.prompt = 7"),
    (request(url="/v1/chat/completions", messages="hi"), "wrong_type", 'body.messages = "hi"'),
    (
        request(
            url="/v1/chat/completions", messages=[{"role": "user", "content": [{"type": "text"}]}]
        ),
        "missing_field",
        "body.messages[0].content[0].text is missing",
    ),
    (request(url="/v1/chat/completions", messages=["hi"]), "wrong_type", 'body.messages[0] = "hi"'),
    (request(prompt_token_ids="1 2"), "wrong_type", "set a list of integers"),
    (request(prompt_token_ids=[1, 2.5]), "wrong_type", "holds 2.5"),
    (request(prompt_token_ids=[1, True]), "wrong_type", "holds true, a boolean"),
    (request(prompt_token_ids=["5"]), "wrong_type", 'holds "5", a string'),
    (request(max_tokens=1.5), "wrong_type", "body.max_tokens = 1.5 is not an integer"),
    (request(temperature="hot"), "wrong_type", 'body.temperature = "hot" is not a number'),
    (request(stop=5), "wrong_type", "body.stop = 5"),
    (request(priority=True), "wrong_type", "body.priority = true"),
    (request(custom_id=""), "invalid_value", "has 0 characters"),
    (request(custom_id="x" * 513), "invalid_value", "has 513 characters"),
    (
        request(priority=10),
        "invalid_value",
        "body.priority = 10 is out of range; set an integer 0..9",
    ),
    (request(temperature=2.5), "invalid_value", "body.temperature = 2.5"),
    (request(top_p=0), "invalid_value", "body.top_p = 0"),
    (request(max_tokens=0), "invalid_value", "body.max_tokens = 0"),
    (request(seed=-1), "invalid_value", "body.seed = -1"),
    (request(stop=["a", "b", "c", "d", "e"]), "invalid_value", "has 5 sequences"),
    (request(stop=[""]), "invalid_value", "empty one"),
    (
        request(url="/v1/chat/completions", messages=[{"role": "robot", "content": "x"}]),
        "invalid_value",
        'role = "robot"',
    ),
    (request(response_format={}), "unsupported_parameter", "body.response_format is not supported"),
    (request() | {"model": "chat"}, "unsupported_parameter", "model is not supported in the line"),
    (
        request(url="/v1/embeddings", model="embedder", input="x", temperature=0),
        "unsupported_parameter",
        "body.temperature",
    ),
    (
        request(url="/v1/embeddings", model="embedder", input="x", encoding_format="int8"),
        "invalid_value",
        'encoding_format = "int8"; use "float" (the default) or "base64"',
    ),
    (
        request(
            url="/v1/chat/completions",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        ),
        "unsupported_content",
        'body.messages[0].content[0] has type "image_url"; model "chat" takes text only',
    ),
    (
        request(
            url="/v1/responses", input=[{"role": "user", "content": [{"type": "input_audio"}]}]
        ),
        "unsupported_content",
        'body.input[0].content[0] has type "input_audio"',
    ),
    (
        request(url="/v1/responses", input="x", stop="a"),
        "unsupported_parameter",
        "body.stop is not supported in /v1/responses body",
    ),
    (
        request(
            url="/v1/chat/completions", messages=[{"role": "user", "content": "x", "name": "a"}]
        ),
        "unsupported_parameter",
        "body.messages[0].name",
    ),
    (
        request(prompt="x", prompt_token_ids=[1]),
        "conflicting_fields",
        "both prompt and prompt_token_ids",
    ),
    (
        request(
            url="/v1/chat/completions",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            max_completion_tokens=4,
        ),
        "conflicting_fields",
        "max_completion_tokens",
    ),
    (request() | {"method": "GET"}, "wrong_method", 'method = "GET"'),
    (request() | {"method": None}, "wrong_type", "method is null; set it to"),
    (request(url="/v1/audio/speech"), "unknown_url", "/v1/audio/speech"),
    (request(model="gpt-4o"), "unknown_model", UNKNOWN_MODEL_MESSAGE),
    (request(url="/v1/embeddings"), "endpoint_not_served", "does not serve /v1/embeddings"),
    (request(model="ids-only"), "text_not_accepted", "send body.prompt_token_ids"),
    (request(prompt=""), "empty_prompt", "body.prompt is an empty string"),
    (request(url="/v1/embeddings", model="embedder", input=""), "empty_prompt", "body.input"),
    (request(prompt=None, prompt_token_ids=[]), "empty_prompt", "prompt_token_ids is empty"),
    (request(url="/v1/chat/completions", messages=[]), "empty_prompt", "messages is empty"),
    (
        request(url="/v1/chat/completions", messages=[{"role": "user", "content": ""}]),
        "empty_prompt",
        "empty content",
    ),
    (
        request(prompt=None, prompt_token_ids=[1, -1]),
        "token_out_of_range",
        "prompt_token_ids[1] = -1",
    ),
    (request(prompt=None, prompt_token_ids=[2**32]), "token_out_of_range", "[0] = 4294967296"),
    (
        request(prompt=None, prompt_token_ids=[3, 2**64 - 1]),
        "token_out_of_range",
        f"[1] = {2**64 - 1}",
    ),
    (
        request(prompt=None, prompt_token_ids=[3, 2**64]),
        "token_out_of_range",
        "prompt_token_ids[1] = 1.8446744073709552e+19 is out of range",
    ),
    (request(prompt=None, prompt_token_ids=[3, -(2**70)]), "token_out_of_range", "[1] = -1.1"),
    (request(prompt=None, prompt_token_ids=[3, 5e9]), "token_out_of_range", "[1] = 5000000000.0"),
    (
        request(url="/v1/embeddings", model="embedder", input=None, prompt_token_ids=[101, 30522]),
        "token_out_of_range",
        'prompt_token_ids[1] = 30522 is beyond the vocabulary of model "embedder": it has '
        "30522 tokens (ids 0..30521)",
    ),
    (
        request(prompt=None, prompt_token_ids=list(range(9))),
        "prompt_too_long",
        'has 9 tokens; model "chat" takes at most 8',
    ),
]


@pytest.mark.parametrize(
    ("line", "code", "says"), BAD_LINES, ids=[f"{c}-{i}" for i, (_, c, _) in enumerate(BAD_LINES)]
)
def test_each_bad_line_gives_one_record_and_the_others_parse(line, code, says):
    line = _clean(line)
    chunks = parse(jsonl(request("before"), line, request("after")))
    [chunk] = chunks
    [error] = chunk.errors
    assert (error.line, error.code) == (2, code)
    assert says in error.message, error.message
    assert chunk.custom_ids == ("before", "after")
    assert chunk.line.tolist() == [1, 3]
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    if isinstance(custom_id, str) and 1 <= len(custom_id) <= 512:
        assert error.custom_id == custom_id
        assert error.message.startswith(f"line 2 (custom_id {json.dumps(custom_id)}): ")
    else:
        assert error.custom_id is None and error.message.startswith("line 2: ")


def _deep(line: dict) -> bytes:
    """`line` as JSON with "DEEP" replaced by 1,000 nested lists (past orjson's writer and
    Python's recursion limit)."""
    return json.dumps(line).encode().replace(b'"DEEP"', b"[" * 1000 + b"]" * 1000)


@pytest.mark.parametrize(
    "line",
    [
        request(custom_id="DEEP"),
        request(model="DEEP"),
        request(prompt_token_ids=["DEEP"], prompt=None),
        request(temperature="DEEP"),
        request(stop=["DEEP"]),
        {"custom_id": "x", "method": "DEEP"},
    ],
    ids=["custom_id", "model", "token", "temperature", "stop", "method"],
)
def test_deeply_nested_values_are_per_line_errors(line):
    [chunk] = parse(jsonl(request("before"), _deep(line), request("after")))
    [error] = chunk.errors
    assert (error.line, error.code) == (2, "wrong_type")
    assert "[[[[" in error.message and len(error.message) < 400, error.message
    assert chunk.custom_ids == ("before", "after")


def test_a_recursion_error_while_checking_a_line_is_that_lines_error(monkeypatch):
    from ingest import line_parser

    def too_deep(*args):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(line_parser, "parse_shape", too_deep)
    [chunk] = parse(jsonl(request("deep")))
    [error] = chunk.errors
    assert (error.line, error.custom_id, error.code) == (1, "deep", "nesting_too_deep")


def _clean(line):
    """Drop keys set to None in a request body (request(model=None) removes the key)."""
    if isinstance(line, dict) and isinstance(line.get("body"), dict):
        line = {**line, "body": {k: v for k, v in line["body"].items() if v is not None}}
    return line


def test_null_parameters_take_their_defaults():
    line = request(max_tokens=None, temperature=None, seed=None, stop=None, priority=None)
    line["body"] = {
        k: None for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "priority")
    } | line["body"]
    [chunk] = parse(jsonl(line))
    assert chunk.errors == ()
    assert chunk.shapes == (Shape("/v1/completions", 256, 1.0, 1.0, None, (), 0),)


def test_line_too_long_is_reported_under_its_number_and_skipped(tmp_path):
    long_line = orjson.dumps(request("long", prompt="x" * 5000))
    data = jsonl(request("a"), long_line, request("b"))
    [chunk] = parse(data, max_line_bytes=1000)
    [error] = chunk.errors
    assert (error.line, error.code, error.custom_id) == (2, "line_too_long", None)
    assert "longer than 1000 bytes" in error.message
    assert chunk.custom_ids == ("a", "b") and chunk.line.tolist() == [1, 3]


def test_blank_lines_crlf_bom_and_a_missing_final_newline_are_fine():
    data = (
        b"\xef\xbb\xbf" + orjson.dumps(request("a")) + b"\r\n\r\n   \n" + orjson.dumps(request("b"))
    )
    [chunk] = parse(data)
    assert chunk.errors == ()
    assert chunk.line.tolist() == [1, 4] and chunk.last_line == 4


def test_strict_mode_raises_on_the_first_bad_line_after_the_chunks_before_it():
    data = jsonl(request("a"), request("b"), request("c"), request("d", model="nope"), request("d"))
    chunks = iter_batch_input(io.BytesIO(data), SETTINGS, chunk_lines=2, strict=True)
    first = next(chunks)
    assert first.custom_ids == ("a", "b")
    with pytest.raises(InputLineError) as caught:
        next(chunks)
    error = caught.value
    assert (error.line, error.custom_id, error.code) == (4, "d", "unknown_model")
    assert str(error).startswith('line 4 (custom_id "d"): body.model = "nope" is not served here')
    assert "strict mode refuses the whole file" in str(error)


def test_strict_mode_reports_the_earliest_line_even_when_a_duplicate_comes_first():
    data = jsonl(request("a"), request("a"), request("z", model="nope"))
    with pytest.raises(InputLineError) as caught:
        parse(data, strict=True)
    assert (caught.value.line, caught.value.code) == (2, "duplicate_custom_id")


def test_duplicates_within_a_chunk_across_chunks_and_after_a_rejected_line():
    data = jsonl(
        request("a"),
        request("b", model="nope"),  # rejected, but claims "b"
        request("a"),
        request("c"),
        request("b"),
        request("c", temperature=9),  # a duplicate and out of range: reported as the duplicate
    )
    chunks = parse(data, chunk_lines=2)
    errors = [(e.line, e.custom_id, e.code) for c in chunks for e in c.errors]
    assert errors == [
        (2, "b", "unknown_model"),
        (3, "a", "duplicate_custom_id"),
        (5, "b", "duplicate_custom_id"),
        (6, "c", "duplicate_custom_id"),
    ]
    assert [c.custom_ids for c in chunks] == [("a",), ("c",), ()]
    assert chunks[1].line.tolist() == [4]


def test_a_shared_custom_id_set_spans_several_sources_of_one_job():
    seen = CustomIdSet()
    parse(jsonl(request("a"), request("b")), custom_ids=seen)
    [chunk] = parse(jsonl(request("b"), request("c")), custom_ids=seen)
    assert [(e.line, e.code) for e in chunk.errors] == [(1, "duplicate_custom_id")]
    assert chunk.custom_ids == ("c",) and len(seen) == 3


def test_dropping_a_duplicate_keeps_the_token_columns_aligned():
    data = jsonl(
        request("a", prompt=None, prompt_token_ids=[1, 2]),
        request("b", prompt=None, prompt_token_ids=[3]),
        request("a", prompt=None, prompt_token_ids=[4, 5, 6]),
        request("c", prompt="text"),
        request("d", prompt=None, prompt_token_ids=[7, 8]),
    )
    [chunk] = parse(data)
    assert chunk.custom_ids == ("a", "b", "c", "d")
    assert chunk.tokens.tolist() == [1, 2, 3, 7, 8]
    assert chunk.offsets.tolist() == [0, 2, 3, 3, 5]
    assert chunk.text_items.tolist() == [2] and chunk.texts == ("text",)


def test_custom_id_set_matches_a_python_set():
    rng = np.random.default_rng(5)
    seen, reference = CustomIdSet(), set()
    for _ in range(60):
        ids = [f"id-{v}" for v in rng.integers(0, 3000, rng.integers(0, 200))]
        repeated = seen.add(ids)
        expected = []
        for cid in ids:
            expected.append(cid in reference)
            reference.add(cid)
        assert repeated.tolist() == expected
    assert len(seen) == len(reference)
    # 16 bytes of digest per id, each run's bucket index (8 bytes per 8 ids or more) and the
    # prefilter (8 to 16 bits per id, 512 bytes at least)
    assert 16 * len(reference) <= seen.nbytes <= 19 * len(reference) + 8 * 24 + 512


def test_custom_id_set_is_exact_when_ids_share_the_high_half_of_their_digest(monkeypatch):
    def weak_digests(ids):  # hi = length: many different ids share it
        hi = np.array([len(i) for i in ids], dtype=np.uint64)
        lo = np.array([int(i.split("-")[1]) for i in ids], dtype=np.uint64)
        return hi, lo

    monkeypatch.setattr(custom_ids, "_digests", weak_digests)
    test_custom_id_set_matches_a_python_set()
    seen = CustomIdSet()
    seen.add(["id-1", "id-2", "id-33"])
    assert seen.contains(["id-2", "id-3", "id-33", "id-44"]).tolist() == [True, False, True, False]


def test_custom_id_set_contains_checks_without_recording():
    seen = CustomIdSet()
    seen.add(["a", "b"])
    assert seen.contains(["b", "c", "c", "a"]).tolist() == [True, False, False, True]
    assert seen.contains([]).tolist() == [] and len(seen) == 2


def test_custom_id_set_stays_compact_with_few_runs():
    seen = CustomIdSet()
    for start in range(0, 200_000, 4096):
        assert not seen.add([f"req-{i}" for i in range(start, min(start + 4096, 200_000))]).any()
    assert len(seen) == 200_000 and 3_200_000 <= seen.nbytes <= 19 * 200_000  # + index, filter
    assert len(seen._runs) <= 8
    assert seen.add(["req-0", "req-199999", "new"]).tolist() == [True, True, False]


class CountingStream(io.RawIOBase):
    """A binary stream that records how far it has been read and the largest read."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self.position = 0
        self.largest_read = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = len(self._data) - self.position if size < 0 else size
        self.largest_read = max(self.largest_read, size)
        block = self._data[self.position : self.position + size].tobytes()
        self.position += len(block)
        return block


def test_50k_lines_stream_in_chunks_of_4096_without_reading_ahead():
    n = 50_000  # 13 chunks, 4 MB: four times the 1 MiB the reader may run ahead (200k: no more)
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 20, n)
    lines = []
    for i in range(n):
        if i % 3:
            body = {"model": "ids-only", "prompt_token_ids": list(range(i % 7, i % 7 + lengths[i]))}
        else:
            body = {"model": "chat", "prompt": f"sentence {i}", "priority": int(i % 10)}
        lines.append(
            orjson.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        )
    lines[777] = b"garbage"
    data = b"\n".join(lines) + b"\n"
    stream = CountingStream(data)
    line_ends = np.cumsum([len(x) + 1 for x in lines])
    expected_end = 0
    items = 0
    for chunk in iter_batch_input(stream, SETTINGS, chunk_lines=4096):
        assert chunk.first_line == expected_end + 1
        assert chunk.last_line - chunk.first_line + 1 <= 4096
        assert chunk.n_items + len(chunk.errors) == chunk.last_line - chunk.first_line + 1
        expected_end = chunk.last_line
        read_so_far = int(line_ends[chunk.last_line - 1])
        assert stream.position <= read_so_far + (1 << 20), "the reader ran ahead of the chunk"
        ids = chunk.line.astype(np.int64) - 1
        expected_lengths = np.where(ids % 3 != 0, lengths[ids], 0)
        assert chunk.lengths.tolist() == expected_lengths.tolist()
        assert chunk.tokens.size == expected_lengths.sum()
        items += chunk.n_items
    assert expected_end == n and items == n - 1
    assert stream.largest_read <= 1 << 20


@pytest.mark.parametrize("block_bytes", [1, 2, 3, 7, 64])
def test_numbered_lines_match_a_plain_split_for_any_block_size(block_bytes):
    data = b"ab\n\ncdefgh\nxyz\r\nlast"
    got = list(numbered_lines(io.BytesIO(data), max_line_bytes=100, block_bytes=block_bytes))
    assert got == list(enumerate(data.split(b"\n"), start=1))
    got = list(numbered_lines(io.BytesIO(data), max_line_bytes=3, block_bytes=block_bytes))
    assert got == [(1, b"ab"), (2, b""), (3, None), (4, None), (5, None)]


@given(st.binary(max_size=300), st.integers(1, 50), st.integers(0, 12))
def test_numbered_lines_property(data, block_bytes, max_line_bytes):
    got = list(
        numbered_lines(io.BytesIO(data), max_line_bytes=max_line_bytes, block_bytes=block_bytes)
    )
    body = data.removeprefix(b"\xef\xbb\xbf")
    parts = body.split(b"\n")
    if parts[-1] == b"":
        parts.pop()
    assert got == [(i, p if len(p) <= max_line_bytes else None) for i, p in enumerate(parts, 1)]


def test_source_errors_name_the_source(tmp_path):
    with pytest.raises(IngestError, match=r"missing\.jsonl: cannot open the input file"):
        list(iter_batch_input(tmp_path / "missing.jsonl", SETTINGS))
    with pytest.raises(IngestError, match="text mode"):
        list(iter_batch_input(io.StringIO("{}\n"), SETTINGS))

    class Broken(io.RawIOBase):
        name = "broken.jsonl"

        def readable(self):
            return True

        def read(self, size=-1):
            raise OSError(5, "Input/output error")

    with pytest.raises(IngestError, match=r"broken\.jsonl: cannot read the input"):
        list(iter_batch_input(Broken(), SETTINGS))


def test_a_stream_is_read_from_where_it_stands_and_left_open():
    stream = io.BytesIO(b"skipped header\n" + jsonl(request("a")))
    stream.readline()
    [chunk] = list(iter_batch_input(stream, SETTINGS))
    assert chunk.custom_ids == ("a",) and chunk.errors == () and not stream.closed


def test_error_record_becomes_an_openai_batch_error_line():
    error = LineError.at(7, "req-7", "unknown_model", "body.model = 'x' is not served here")
    assert orjson.loads(error.to_batch_error_line("job-1")) == {
        "id": "job-1-line-7",
        "custom_id": "req-7",
        "response": None,
        "error": {
            "code": "unknown_model",
            "message": "line 7 (custom_id \"req-7\"): body.model = 'x' is not served here",
        },
    }
    assert error.to_batch_error_line("job-1").endswith(b"}\n")
    assert LineError.at(3, None, "invalid_json", "bad").to_batch_error()["id"] == "line-3"


def test_long_values_are_cut_short_in_messages():
    [chunk] = parse(jsonl(request(model="m" * 5000)))
    assert len(chunk.errors[0].message) < 400


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=6,
)


PROMPTS = {
    "/v1/embeddings": ("embedder", "input", st.text(min_size=1, max_size=10)),
    "/v1/chat/completions": (
        "chat",
        "messages",
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=5)}
            ),
            min_size=1,
            max_size=3,
        ),
    ),
    "/v1/completions": ("chat", "prompt", st.text(min_size=1, max_size=10)),
}
GENERATE = {
    "max_tokens": st.integers(1, 300),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 5),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
}


@st.composite
def valid_requests(draw):
    """A request that passes every check, mostly (its custom_id may repeat)."""
    url = draw(st.sampled_from(list(PROMPTS)))
    model, field, text = PROMPTS[url]
    if draw(st.booleans()):
        body = {"model": "ids-only" if url != "/v1/embeddings" else "embedder"}
        body["prompt_token_ids"] = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8))
    else:
        body = {"model": model, field: draw(text)}
    params = GENERATE if url != "/v1/embeddings" else {}
    body |= draw(st.fixed_dictionaries({}, optional={**params, "priority": st.integers(0, 9)}))
    custom_id = draw(st.text(min_size=1, max_size=3))
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


BODY_KEYS = ("model", "input", "messages", "prompt", "prompt_token_ids", "n", "user")
PATHS = [
    ("custom_id",),
    ("method",),
    ("url",),
    ("body",),
    ("extra",),
    *[("body", key) for key in (*BODY_KEYS, *GENERATE, "encoding_format", "priority")],
    ("body", "max_completion_tokens"),
]
DELETE = object()


@st.composite
def mutated_requests(draw):
    """A valid request with up to two fields replaced by any JSON value or deleted."""
    line = draw(valid_requests())
    for path in draw(st.lists(st.sampled_from(PATHS), max_size=2)):
        value = draw(st.just(DELETE) | JSON)
        parent = line if len(path) == 1 else line.get("body")
        if isinstance(parent, dict):
            if value is DELETE:
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = value
    return line


LINES = st.lists(
    st.binary(max_size=40) | mutated_requests().map(lambda r: json.dumps(r).encode()), max_size=25
)


@hsettings(
    max_examples=fuzz_examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(LINES, st.integers(1, 6))
def test_random_lines_never_raise_and_every_line_is_accounted_for(lines, chunk_lines):
    data = b"\n".join(line.replace(b"\n", b" ") for line in lines)
    chunks = parse(data, chunk_lines=chunk_lines, max_line_bytes=400)
    seen_lines = []
    for chunk in chunks:
        assert chunk.last_line - chunk.first_line + 1 <= chunk_lines
        assert chunk.offsets.size == chunk.n_items + 1 and chunk.offsets[-1] == chunk.tokens.size
        assert all(e.code in CODES for e in chunk.errors)
        for error in chunk.errors:
            event(error.code)  # pytest --hypothesis-show-statistics shows which checks ran
        if chunk.n_items:
            event("accepted")
        seen_lines += chunk.line.tolist() + [e.line for e in chunk.errors]
    blank = {
        i
        for i, line in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1)
        if not line.strip()
    }
    assert sorted(seen_lines) == sorted(set(seen_lines))
    assert set(seen_lines) | blank >= set(range(1, (chunks[-1].last_line if chunks else 0) + 1))


def test_the_vocabulary_comes_from_the_config_else_the_tokenizer_else_the_engine(tmp_path):
    """Point 6 of issue 14: an id at or beyond the model's vocabulary is refused per line."""
    from broker import WORDS, build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "words.json")  # [UNK] and WORDS
    models = [
        {"name": "set", "engine": "transformers", "vocab_size": 50},
        {"name": "words", "engine": "echo", "tokenizer": str(tokenizer)},
        {"name": "mini", "engine": "minilm"},
        {"name": "any", "engine": "echo"},
    ]
    settings = load_settings(None, {"models": models})
    ids = {"set": 50, "words": len(WORDS) + 1, "mini": 30522, "any": 2**32 - 1}
    lines = []
    for model, first_bad in ids.items():
        url = "/v1/embeddings" if model == "mini" else "/v1/completions"
        body = {"model": model}
        lines.append(request(f"{model}-ok", url, prompt_token_ids=[first_bad - 1], **body))
        lines.append(request(f"{model}-bad", url, prompt_token_ids=[0, first_bad], **body))
    [chunk] = list(iter_batch_input(io.BytesIO(jsonl(*lines)), settings))
    assert chunk.custom_ids == ("set-ok", "words-ok", "mini-ok", "any-ok", "any-bad")
    errors = {e.custom_id: e for e in chunk.errors}
    assert set(errors) == {"set-bad", "words-bad", "mini-bad"}
    for model in ("set", "words", "mini"):
        error = errors[f"{model}-bad"]
        assert error.code == "token_out_of_range"
        assert f"[1] = {ids[model]} is beyond the vocabulary" in error.message
        assert f"it has {ids[model]} tokens" in error.message


def test_embedding_lines_of_one_shape_share_one_shape_instead_of_one_per_line():
    from ingest.request_shape import parse_shape

    data = jsonl(
        *(request(f"e{i}", "/v1/embeddings", model="embedder", input="x") for i in range(3)),
        request("f", "/v1/embeddings", model="embedder", input="x", encoding_format="float"),
        request("b", "/v1/embeddings", model="embedder", input="x", encoding_format="base64"),
        request("p", "/v1/embeddings", model="embedder", input="x", priority=3),
    )
    [chunk] = parse(data)
    assert chunk.shape_index.tolist() == [0, 0, 0, 0, 1, 2]
    plain = Shape("/v1/embeddings", None, None, None, None, (), 0)
    assert chunk.shapes == (
        plain,
        Shape("/v1/embeddings", None, None, None, None, (), 0, "base64"),
        Shape("/v1/embeddings", None, None, None, None, (), 3),
    )
    body = {"model": "embedder", "input": "x"}
    assert parse_shape(body, "/v1/embeddings") is parse_shape(dict(body), "/v1/embeddings")
