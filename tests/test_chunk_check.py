"""The front's re-check of a chunk, one rule at a time."""

from __future__ import annotations

import numpy as np

from config import load_settings
from ingest.catalog import ModelCatalog
from ingest.chunk_check import members_of, recheck, repeats_within
from ingest.custom_ids import CustomIdSet
from ingest.input_chunk import InputChunk
from ingest.request_shape import Shape

EMBED = Shape("/v1/embeddings", None, None, None, None, (), 0)
CHAT = Shape("/v1/chat/completions", 16, 1.0, 1.0, None, (), 0)


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
