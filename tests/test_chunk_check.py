"""The front's re-check of a chunk, one rule at a time."""

from __future__ import annotations

import numpy as np

from config import load_settings
from ingest.catalog import ModelCatalog
from ingest.chunk_check import item_max, members_of, recheck, repeats_within
from ingest.custom_ids import CustomIdSet
from ingest.input_chunk import InputChunk
from ingest.request_shape import Shape

EMBED = Shape("/v1/embeddings", None, None, None, None, (), 0)
CHAT = Shape("/v1/chat/completions", 16, 1.0, 1.0, None, (), 0)
EMBEDS = ["/v1/embeddings"]


def catalog() -> ModelCatalog:
    settings = load_settings(
        None,
        {
            "broker": {"lanes": [64, 128]},
            "models": [
                {
                    "name": "emb",
                    "engine": "echo",
                    "endpoints": ["/v1/embeddings"],
                    "max_tokens": 100,
                },
                {"name": "gen", "engine": "echo", "tokenizer": "t.json", "max_tokens": 128},
            ],
        },
    )
    return ModelCatalog.from_settings(settings)


def chunk(
    rows: list[tuple[str, str, Shape, int]], texts: dict[int, str] | None = None
) -> InputChunk:
    """rows: (custom_id, model, shape, n_tokens); texts: item position -> text prompt."""
    texts = texts or {}
    models = sorted({m for _, m, _, _ in rows})
    shapes = [EMBED, CHAT]
    lengths = np.array([0 if i in texts else n for i, (_, _, _, n) in enumerate(rows)], np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return InputChunk(
        index=0,
        first_line=1,
        last_line=len(rows),
        line=np.arange(1, len(rows) + 1, dtype=np.uint64),
        custom_ids=tuple(r[0] for r in rows),
        models=tuple(models),
        model_index=np.array([models.index(r[1]) for r in rows]),
        shapes=tuple(shapes),
        shape_index=np.array([shapes.index(r[2]) for r in rows]),
        tokens=np.ones(int(offsets[-1]), np.uint32),
        offsets=offsets,
        text_items=np.array(sorted(texts), np.int64),
        texts=tuple(texts[i] for i in sorted(texts)),
        errors=(),
    )


def test_each_rule_rejects_only_its_items_with_line_and_reason():
    rows = [
        ("a", "emb", EMBED, 10),  # fine
        ("b", "nope", EMBED, 10),  # unknown model
        ("c", "emb", CHAT, 10),  # endpoint not served
        ("d", "emb", EMBED, 101),  # longer than max_tokens
        ("e", "emb", EMBED, 0),  # empty
        ("f", "emb", EMBED, 5),  # text for a model without a tokenizer
        ("a", "emb", EMBED, 5),  # repeats line 1
        ("g", "gen", CHAT, 0),  # text for a model with one: fine
    ]
    checked = recheck(chunk(rows, {5: "hi", 7: "hello"}), catalog(), CustomIdSet(), [], None)
    got = {(e.line, e.code) for e in checked.chunk.errors}
    assert got == {
        (2, "unknown_model"),
        (3, "endpoint_not_served"),
        (4, "prompt_too_long"),
        (5, "empty_prompt"),
        (6, "text_not_accepted"),
        (7, "duplicate_custom_id"),
    }
    assert checked.chunk.custom_ids == ("a", "g")
    assert len(checked.digests[0]) == 2
    assert all("line" in e.message for e in checked.chunk.errors)


def test_repeats_of_committed_and_in_flight_ids_and_items_already_stored():
    committed = CustomIdSet()
    committed.add(["old"])
    rows = [
        ("old", "emb", EMBED, 3),
        ("busy", "emb", EMBED, 3),
        ("x", "emb", EMBED, 3),
        ("y", "emb", EMBED, 3),
    ]
    other = recheck(chunk([("busy", "emb", EMBED, 3)]), catalog(), CustomIdSet(), [], None)
    checked = recheck(chunk(rows), catalog(), committed, [other.digests[0]], np.array([3]))
    assert [e.custom_id for e in checked.chunk.errors] == ["old", "busy"]
    assert checked.already == [(4, "y")]
    assert checked.chunk.custom_ids == ("x",)


def test_vector_helpers():
    keys = np.array([5, 3, 5, 9, 3], dtype=np.uint64)
    assert repeats_within(keys).tolist() == [False, False, True, False, True]
    assert members_of(keys, np.zeros(0, np.uint64)).tolist() == [False] * 5
    assert members_of(keys, np.array([3, 4], np.uint64)).tolist() == [
        False,
        True,
        False,
        False,
        True,
    ]


def test_ids_beyond_the_vocabulary_are_refused_naming_the_id_its_position_and_the_size():
    """Point 6 of issue 14: the front refuses what the model cannot run, whatever the SDK did."""
    settings = load_settings(
        None,
        {
            "broker": {"lanes": [64, 32768]},
            "models": [
                {"name": "small", "engine": "echo", "vocab_size": 100, "endpoints": EMBEDS},
                {"name": "mini", "engine": "minilm", "max_tokens": 64},  # the engine: 30522
                {"name": "any", "engine": "echo", "endpoints": EMBEDS},  # no limit
            ],
        },
    )
    rows = [
        ("a", "small", EMBED, 3),
        ("b", "small", EMBED, 4),
        ("c", "any", EMBED, 2),
        ("d", "mini", EMBED, 3),
        ("e", "mini", EMBED, 0),
        ("f", "mini", EMBED, 2),
    ]
    built = chunk(rows)
    built.tokens[:] = [1, 2, 99, 1, 2, 100, 3, 2**32 - 1, 7, 101, 30522, 102, 30521, 0]
    checked = recheck(built, ModelCatalog.from_settings(settings), CustomIdSet(), [], None)
    got = {(e.line, e.code): e.message for e in checked.chunk.errors}
    assert set(got) == {(2, "token_out_of_range"), (4, "token_out_of_range"), (5, "empty_prompt")}
    assert "prompt_token_ids[2] = 100 is beyond the vocabulary" in got[(2, "token_out_of_range")]
    assert "it has 100 tokens (ids 0..99)" in got[(2, "token_out_of_range")]
    assert (
        'prompt_token_ids[1] = 30522 is beyond the vocabulary of model "mini"'
        in got[(4, "token_out_of_range")]
    )
    assert checked.chunk.custom_ids == ("a", "c", "f")


def test_item_max_skips_empty_items():
    tokens = np.array([5, 9, 1, 7], np.uint32)
    offsets = np.array([0, 0, 2, 2, 3, 4, 4])
    assert item_max(tokens, offsets).tolist() == [-1, 9, -1, 1, 7, -1]


def test_the_front_refuses_chunks_past_its_byte_caps_but_never_a_first_one():
    """Point 10 of issue 14: bytes of chunks in flight are capped per producer and in all."""
    from types import SimpleNamespace

    from ingest.inflight import InflightChunks

    inflight = InflightChunks(max_chunks=64, producer_chunks=8, max_bytes=250, producer_bytes=100)
    a, b, c = (b"a",), (b"b",), (b"c",)
    assert inflight.busy(a, 500) is None  # holding nothing: one chunk may always come
    inflight.by_key = {
        1: SimpleNamespace(route=a, nbytes=60),
        2: SimpleNamespace(route=b, nbytes=90),
    }
    assert "ingest.producer_inflight_bytes = 100" in inflight.busy(a, 41)
    assert inflight.busy(a, 40) is None
    assert inflight.busy(c, 100) is None
    assert "ingest.max_inflight_bytes = 250" in inflight.busy(c, 101)
    inflight.producer_chunks = 1
    assert "ingest.producer_chunks_in_flight" in inflight.busy(a, 1)


def test_offsets_that_wrap_around_in_a_difference_are_refused_naming_the_array():
    """The one offsets rule (pipeline/core/ragged.py) compares offsets instead of subtracting them:
    a difference of int64s wraps and once let [0, 2**63 - 1, -2**63, -1, 2] pass."""
    import pytest

    from ingest.chunk_wire import chunk_from_wire
    from ingest.error_wire import errors_from_wire, errors_to_wire
    from ingest.line_errors import LineError
    from pipeline.core.errors import WireError

    good = {
        "line": np.arange(1, 5, dtype="<u8"),
        "ids": np.frombuffer(b"ab", np.uint8),
        "ids_offsets": np.array([0, 1, 1, 1, 2], "<i8"),
        "model_index": np.zeros(4, "<u4"),
        "shape_index": np.zeros(4, "<u4"),
        "tokens": np.arange(4, dtype="<u4"),
        "offsets": np.array([0, 1, 2, 3, 4], "<i8"),
        "text_items": np.zeros(0, "<i8"),
        "texts": np.frombuffer(b"[]", np.uint8),
        "errors": np.frombuffer(b"[]", np.uint8),
    }
    meta = {
        "index": 0,
        "first_line": 1,
        "last_line": 4,
        "models": ["echo"],
        "shapes": [{"endpoint": "/v1/embeddings"}],
    }
    assert chunk_from_wire(meta, good).custom_ids == ("a", "", "", "b")
    wraps = np.array([0, 2**63 - 1, -(2**63), -1, 2], "<i8")
    with pytest.raises(WireError, match="custom_id offsets into 2 entries: offsets decrease"):
        chunk_from_wire(meta, {**good, "ids_offsets": wraps})
    with pytest.raises(WireError, match="token offsets into 4 entries: 4 offsets for 4 rows"):
        chunk_from_wire(meta, {**good, "offsets": np.array([0, 1, 2, 4], "<i8")})
    errors = errors_to_wire([LineError(n, "x", "bad", "why") for n in (1, 2, 3, 4)])
    assert len(errors_from_wire(errors)) == 4
    errors["err_ids_offsets"] = np.array([0, 2**63 - 1, -(2**63), -1, 4], "<i8")
    with pytest.raises(WireError, match="err_ids_offsets into 4 bytes: offsets decrease"):
        errors_from_wire(errors)
