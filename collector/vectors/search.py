"""Exact top-k search over every durable row of a store's shards, one bounded block at a time.

Each shard is read through its read-only memmap in blocks of `block_rows`
rows, so memory is bounded by the block (`block_rows * dim * 4` bytes of
float32 plus the `[q, block_rows]` scores), never by the store. Math is
float32. `cosine` normalises the query and divides each block's dot products
by that block's row norms (the same as normalising the block, without a
copy of it); a zero row scores 0. Each block's top-k is taken with
`np.argpartition` and merged into the running top-k; the result is sorted,
best first. Rows appended but not flushed are never searched.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from collector.vectors.shard import Shard
from collector.vectors.vector_errors import VectorInputError
from collector.vectors.vector_store import VectorStore

METRICS = ("cosine", "dot")
REF_DTYPE = np.dtype([("shard", "<u4"), ("row", "<u8"), ("id", "<u8")])


def _shards(store_or_shards: VectorStore | Shard | Iterable[Shard]) -> list[Shard]:
    if isinstance(store_or_shards, VectorStore):
        return list(store_or_shards.shards)
    if isinstance(store_or_shards, Shard):
        return [store_or_shards]
    return list(store_or_shards)


def check_query(query: np.ndarray, dim: int, metric: str) -> np.ndarray:
    """The query as a C-contiguous float32 `[q, dim]` array (normalised for cosine), or an error."""
    if metric not in METRICS:
        raise VectorInputError(f"metric {metric!r} is not supported; use one of {METRICS}")
    query = np.asarray(query)
    if query.ndim != 2 or query.shape[1] != dim or query.shape[0] < 1:
        raise VectorInputError(
            f"query has shape {query.shape}; the store holds dim {dim}, so pass (q, {dim}) with q >= 1"
        )
    if query.dtype.kind not in "fiu":
        raise VectorInputError(f"query of dtype {query.dtype} is not numeric")
    with np.errstate(over="ignore"):
        query = np.ascontiguousarray(query, dtype=np.float32)
    bad = ~np.isfinite(query).all(axis=1)
    if bad.any():
        raise VectorInputError(
            f"query row {int(np.flatnonzero(bad)[0])} has NaN or infinite values (as float32)"
        )
    if metric == "cosine":
        norms = np.linalg.norm(query, axis=1)
        if (norms == 0).any():
            raise VectorInputError(
                f"query row {int(np.flatnonzero(norms == 0)[0])} is all zeros; "
                "cosine similarity is undefined for it"
            )
        query = query / norms[:, None]
    return query


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest scores of each row (unordered)."""
    if k >= scores.shape[1]:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    return np.argpartition(scores, scores.shape[1] - k, axis=1)[:, -k:]


def search(
    store_or_shards: VectorStore | Shard | Iterable[Shard],
    query: np.ndarray,
    k: int,
    metric: str = "cosine",
    block_rows: int = 65536,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k: `(scores [q, k'], refs [q, k'] of REF_DTYPE)`, best first.

    `k' = min(k, durable rows)`: asking for more rows than the store holds
    returns all of them. Ties are broken arbitrarily.
    """
    shards = _shards(store_or_shards)
    if not shards:
        raise VectorInputError("nothing to search: no shards")
    dim = shards[0].dim
    for shard in shards:
        if shard.dim != dim:
            raise VectorInputError(
                f"shard {shard.shard_id} has dim {shard.dim}, shard {shards[0].shard_id} has {dim}"
            )
    if not isinstance(k, int | np.integer) or k < 1:
        raise VectorInputError(f"k {k!r} must be a positive integer")
    if not isinstance(block_rows, int | np.integer) or block_rows < 1:
        raise VectorInputError(f"block_rows {block_rows!r} must be a positive integer")
    query = check_query(query, dim, metric)
    q = len(query)
    best_scores = np.empty((q, 0), np.float32)
    best_refs = np.empty((q, 0), REF_DTYPE)
    for shard in shards:
        for first in range(0, shard.rows, block_rows):
            count = min(block_rows, shard.rows - first)
            ids, rows = shard.read(first, count)
            block = rows if rows.dtype == np.float32 else rows.astype(np.float32)
            scores = query @ block.T
            if metric == "cosine":
                norms = np.sqrt(np.einsum("ij,ij->i", block, block))
                norms[norms == 0] = 1.0  # a zero row scores 0, not NaN
                scores /= norms
            cols = _top(scores, k)
            refs = np.empty(cols.shape, REF_DTYPE)
            refs["shard"] = shard.shard_id
            refs["row"] = first + cols
            refs["id"] = np.asarray(ids)[cols]
            merged_scores = np.concatenate(
                [best_scores, np.take_along_axis(scores, cols, axis=1)], axis=1
            )
            merged_refs = np.concatenate([best_refs, refs], axis=1)
            keep = _top(merged_scores, k)
            best_scores = np.take_along_axis(merged_scores, keep, axis=1)
            best_refs = np.take_along_axis(merged_refs, keep, axis=1)
            del ids, rows, block
    order = np.argsort(-best_scores, axis=1, kind="stable")
    return np.take_along_axis(best_scores, order, axis=1), np.take_along_axis(
        best_refs, order, axis=1
    )
