"""What a shard stores per row: the row dtypes (`DTYPES`), the id dtype (`IDS_DTYPE`), and
the check every append's ids and rows pass first (`validate_rows`).

Rows are `dim` values of `float16` or `float32`, little-endian; each row's id is
a u64, little-endian (the files they go to: `collector.vectors.shard`).
"""

from __future__ import annotations

import numpy as np

from collector.vectors.vector_errors import VectorInputError

DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
IDS_DTYPE = np.dtype("<u8")


def validate_rows(
    ids: np.ndarray, rows: np.ndarray, dim: int, dtype: np.dtype, shard_id: int, copy: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """`ids` as u64 and `rows` as `dtype` for shard `shard_id` of `dim` (copies, unless `copy`
    is False and they already are), or a `VectorInputError`."""
    rows = np.asarray(rows)
    ids = np.asarray(ids)
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise VectorInputError(f"rows have shape {rows.shape}; shard {shard_id} takes (n, {dim})")
    if rows.dtype.kind not in "fiu" or not np.can_cast(rows.dtype, dtype, "same_kind"):
        raise VectorInputError(f"rows of dtype {rows.dtype} cannot be stored as {dtype}")
    if ids.shape != (len(rows),) or ids.dtype.kind not in "iu":
        raise VectorInputError(
            f"ids have shape {ids.shape} and dtype {ids.dtype}; need {len(rows)} integers"
        )
    if ids.dtype.kind == "i" and len(ids) and ids.min() < 0:
        raise VectorInputError(f"id {ids.min()} at row {int(ids.argmin())} is negative")
    with np.errstate(over="ignore"):
        stored = np.ascontiguousarray(rows.astype(dtype, copy=copy))
    with np.errstate(over="ignore", invalid="ignore"):  # a NaN or inf makes its row sum one
        sums_finite = np.isfinite(stored.sum(axis=1, dtype=np.float32)).all()
    bad = None if sums_finite else ~np.isfinite(stored).all(axis=1)
    if bad is not None and bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise VectorInputError(
            f"row {row} of the batch (id {int(ids[row])}) has NaN or infinite values "
            f"as {dtype}; nothing was appended"
        )
    return np.ascontiguousarray(ids.astype(IDS_DTYPE, copy=copy)), stored
