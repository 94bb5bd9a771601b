"""Exact search over a real multi-shard store, checked against brute-force numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from collector.vectors.search import search
from collector.vectors.vector_errors import VectorInputError
from collector.vectors.vector_store import VectorStore

DIM = 24
ROWS = 3000
SHARD_ROWS = 700  # five shards, the last partial


@pytest.fixture
def store(tmp_path: Path):
    rng = np.random.default_rng(7)
    data = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ids = np.arange(ROWS, dtype=np.uint64) + 1000
    with VectorStore(tmp_path / "store", DIM, "float32", SHARD_ROWS) as opened:
        for start in range(0, ROWS, 512):
            opened.append(ids[start : start + 512], data[start : start + 512])
        opened.flush()
        opened.append(ids[:5], data[:5])  # queued, never flushed: must not be found
        yield opened, data, ids


def brute(data: np.ndarray, query: np.ndarray, k: int, metric: str) -> np.ndarray:
    if metric == "cosine":
        data = data / np.linalg.norm(data, axis=1, keepdims=True)
        query = query / np.linalg.norm(query, axis=1, keepdims=True)
    scores = query @ data.T
    return np.sort(scores, axis=1)[:, ::-1][:, :k]


def check(found, data, ids, query, k, metric):
    scores, refs = found
    want = brute(data, query, k, metric)
    assert scores.shape == refs.shape == want.shape
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-4)
    flat_rows = refs["shard"].astype(np.int64) * SHARD_ROWS + refs["row"].astype(np.int64)
    np.testing.assert_array_equal(refs["id"], ids[flat_rows])
    # each ref's own score matches the score recomputed from the data it points at
    if metric == "cosine":
        data = data / np.linalg.norm(data, axis=1, keepdims=True)
        query = query / np.linalg.norm(query, axis=1, keepdims=True)
    recomputed = np.einsum("qd,qkd->qk", query, data[flat_rows])
    np.testing.assert_allclose(scores, recomputed, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_matches_brute_force(store, metric):
    opened, data, ids = store
    assert len(opened.shards) == 5
    query = np.random.default_rng(1).standard_normal((6, DIM)).astype(np.float32)
    check(search(opened, query, 10, metric=metric), data, ids, query, 10, metric)


def test_cosine_and_dot_differ_by_row_norms(store):
    opened, data, _ = store
    query = data[[42]] * 3.0
    cos_scores, cos_refs = search(opened, query, 1, metric="cosine")
    assert cos_refs["id"][0, 0] == 1042
    assert cos_scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    dot_scores, _ = search(opened, query, 1, metric="dot")
    assert dot_scores[0, 0] == pytest.approx((query @ data.T).max(), rel=1e-5)


def test_k_larger_than_rows_returns_every_row(store):
    opened, data, ids = store
    query = np.ones((2, DIM), np.float32)
    scores, refs = search(opened, query, ROWS + 50, metric="dot")
    assert scores.shape == (2, ROWS)
    assert (np.diff(scores, axis=1) <= 0).all()
    assert sorted(refs["id"][0].tolist()) == ids.tolist()
    check((scores, refs), data, ids, query, ROWS, "dot")


@pytest.mark.parametrize("block_rows", [1, 97, 700, 10_000])
def test_block_size_does_not_change_the_answer(store, block_rows):
    opened, data, ids = store
    query = np.random.default_rng(2).standard_normal((3, DIM)).astype(np.float32)
    found = search(opened, query, 7, metric="cosine", block_rows=block_rows)
    check(found, data, ids, query, 7, "cosine")
    reference = search(opened, query, 7, metric="cosine")
    np.testing.assert_allclose(found[0], reference[0], rtol=1e-5, atol=1e-6)


def test_float16_shards_and_a_list_of_shards(tmp_path):
    data = np.random.default_rng(3).standard_normal((400, DIM)).astype(np.float16)
    ids = np.arange(400, dtype=np.uint64)
    with VectorStore(tmp_path / "s16", DIM, "float16", 150) as opened:
        opened.append(ids, data)
        opened.flush()
        scores, _ = search(opened.shards, data[:2].astype(np.float32), 3, metric="dot")
    want = brute(data.astype(np.float32), data[:2].astype(np.float32), 3, "dot")
    np.testing.assert_allclose(scores, want, rtol=1e-4)


@pytest.mark.parametrize(
    ("query", "k", "metric", "message"),
    [
        (np.ones((1, DIM + 1)), 3, "dot", "shape"),
        (np.ones(DIM), 3, "dot", "shape"),
        (np.ones((0, DIM)), 3, "dot", "shape"),
        (np.full((2, DIM), np.nan), 3, "dot", "NaN"),
        (np.full((1, DIM), np.inf), 3, "cosine", "NaN"),
        (np.zeros((1, DIM)), 3, "cosine", "all zeros"),
        (np.array([["a"] * DIM]), 3, "dot", "not numeric"),
        (np.ones((1, DIM)), 0, "dot", "k 0"),
        (np.ones((1, DIM)), 3, "l2", "metric"),
    ],
)
def test_bad_query_refused(store, query, k, metric, message):
    opened, _, _ = store
    with pytest.raises(VectorInputError, match=message):
        search(opened, query, k, metric=metric)


def test_empty_store_and_no_shards(tmp_path):
    with (
        VectorStore(tmp_path / "empty", DIM, "float32", 10) as opened,
        pytest.raises(VectorInputError, match="no shards"),
    ):
        search(opened, np.ones((1, DIM)), 3)
