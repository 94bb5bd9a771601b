"""An item's seq: the one number that names an item everywhere, `job_no << 32 | index`.

The front gives every accepted line of a job an `index` (0-based, its place
in the job); the seq joins it to the job's number. Segments, the dispatch
state, worker batches, completion's store and the vector stores all carry the
seq, and a retried chunk carries the same seqs, so it names the same items.

| bits  | field    | range          |
|-------|----------|----------------|
| 63-32 | `job_no` | 1 .. 2**32 - 1 |
| 31-0  | `index`  | 0 .. 2**32 - 1 |

An index below `PART_BASE` (2**31) is a line's own: line - 1, the line's
first (often only) part. A line with k > 1 parts (fan-out: docs/completion.md,
"Lines and parts") has its parts 1..k-1 at consecutive indexes from
`PART_BASE` on, in reading order; the job's chunk journal maps them to
their line.

Seq 0 is never an item (no job has number 0): an all-zero slot header is
unwritten. Every function here takes and returns numpy arrays (uint64 seqs,
int64 numbers) or Python ints alike; nothing else spells the layout out.
"""

from __future__ import annotations

from typing import overload

import numpy as np

INDEX_BITS = 32
INDEX_MASK = (1 << INDEX_BITS) - 1
PART_BASE = 1 << 31  # indexes from here on are parts 1.. of fan-out lines
_SHIFT = np.uint64(INDEX_BITS)
_MASK = np.uint64(INDEX_MASK)


@overload
def seq_of(job_no: int, index: int) -> int: ...
@overload
def seq_of(job_no: int | np.ndarray, index: np.ndarray) -> np.ndarray: ...
def seq_of(job_no, index):
    """The seq of item `index` of job `job_no` (either or both may be arrays)."""
    if isinstance(job_no, int) and isinstance(index, int):
        return (job_no << INDEX_BITS) | index
    return (np.asarray(job_no, dtype=np.uint64) << _SHIFT) | np.asarray(index, dtype=np.uint64)


@overload
def job_of(seq: int) -> int: ...
@overload
def job_of(seq: np.ndarray) -> np.ndarray: ...
def job_of(seq):
    """The job number of each seq (int64 for arrays)."""
    if isinstance(seq, int):
        return seq >> INDEX_BITS
    return (np.asarray(seq, dtype=np.uint64) >> _SHIFT).astype(np.int64)


@overload
def index_of(seq: int) -> int: ...
@overload
def index_of(seq: np.ndarray) -> np.ndarray: ...
def index_of(seq):
    """The index within its job of each seq (int64 for arrays)."""
    if isinstance(seq, int):
        return seq & INDEX_MASK
    return (np.asarray(seq, dtype=np.uint64) & _MASK).astype(np.int64)


def seq_range(job_no: int, first_index: int, last_index: int) -> tuple[np.uint64, np.uint64]:
    """The seqs of items first_index .. last_index (inclusive) of one job, as uint64 bounds."""
    return np.uint64(seq_of(job_no, first_index)), np.uint64(seq_of(job_no, last_index))


def consistent(seq: np.ndarray, job_no: np.ndarray, index: np.ndarray) -> np.ndarray:
    """True where a header's seq agrees with its own job and index columns, and is not 0."""
    seq = np.asarray(seq, dtype=np.uint64)
    return (
        (seq != 0)
        & ((seq >> _SHIFT) == np.asarray(job_no, dtype=np.uint64))
        & ((seq & _MASK) == np.asarray(index, dtype=np.uint64))
    )
