"""Ragged arrays: n variable-length rows stored back to back, and the one offsets rule.

A `Ragged` is `values` (one flat array: token ids, result bytes, floats) and
`offsets`, n + 1 int64 positions into it: row i is
`values[offsets[i]:offsets[i + 1]]`. Chunks on the wire, ring records,
completion's result pages and delivery all hold their rows this way; every
gather, scatter and pad of such rows, and every check of offsets that came
from outside the process, is written here once, vectorised (no Python loop
per row).

The offsets rule (`offsets_problem`), for offsets read from a wire message or
a file: exactly n + 1 of them, integers, starting at 0, never decreasing, and
ending at `len(values)`, so no row can index outside what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def offsets_problem(offsets: np.ndarray, n: int, size: int) -> str | None:
    """What breaks the offsets rule for `n` rows over `size` values, or None if nothing."""
    if offsets.ndim != 1 or len(offsets) != n + 1:
        return f"{len(offsets)} offsets for {n} rows (want {n + 1})"
    if offsets.dtype.kind not in "ui":
        return f"offsets are {offsets.dtype.str}, not integers"
    if int(offsets[0]) != 0 or int(offsets[-1]) != size:
        return f"offsets run from {int(offsets[0])} to {int(offsets[-1])}, not from 0 to {size}"
    # compared, not subtracted: a difference of int64s or uint64s can wrap around and hide a
    # step back (from 0 up to `size` without one, no offset can leave 0..size)
    if not bool(np.all(offsets[1:] >= offsets[:-1])):
        return "offsets decrease"
    return None


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """n + 1 int64 offsets for rows of these lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions starts[i] .. starts[i] + lengths[i] - 1 of every i, concatenated (int64)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def scatter(
    dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> None:
    """Copy src[starts[j]:ends[j]] to dst[dst_starts[j]:...] for every j."""
    lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    if int(lengths.sum()) == 0:
        return
    dst[ranges(dst_starts, lengths)] = src[ranges(starts, lengths)]


def pad(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int | None = None):
    """Rows values[starts[i] : starts[i] + lengths[i]] zero-padded to `width` (default: the
    longest) as one [n, width] array of values' dtype. One reshape when the rows lie back to back
    and are all full; a masked gather otherwise."""
    n = len(lengths)
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max()) if n else 0
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a row of {longest} values does not fit a width of {width}")
    total = int(lengths.sum())
    back_to_back = n == 0 or bool(np.all(starts[1:] == starts[:-1] + lengths[:-1]))
    if back_to_back:
        run = values[int(starts[0]) : int(starts[0]) + total] if n else values[:0]
        if total == n * width:
            return run.reshape(n, width)
    else:
        run = values[ranges(starts, lengths)]
    out = np.zeros((n, width), dtype=values.dtype)
    out[np.arange(width)[None, :] < lengths[:, None]] = run
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Ragged:
    """n rows of `values`, row i at values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def checked(cls, values: np.ndarray, offsets: np.ndarray, what: str = "rows") -> Ragged:
        """A Ragged from untrusted arrays; ValueError naming `what` if the offsets break the rule."""
        n = len(offsets) - 1
        problem = offsets_problem(offsets, max(n, 0), len(values))
        if problem:
            raise ValueError(f"{what}: {problem}")
        return cls(values, offsets.astype(np.int64, copy=False))

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> Ragged:
        return cls(values, offsets_of(lengths))

    @classmethod
    def from_rows(cls, rows: list[np.ndarray], dtype) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        values = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
        return cls(values, offsets_of(lengths))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def take(self, pick: np.ndarray) -> Ragged:
        """The rows at `pick` (indices or a boolean mask), in that order."""
        pick = np.flatnonzero(pick) if np.asarray(pick).dtype == bool else np.asarray(pick)
        lengths = self.lengths[pick]
        return Ragged(self.values[ranges(self.starts[pick], lengths)], offsets_of(lengths))

    def padded(self, width: int | None = None) -> np.ndarray:
        """The rows as one zero-padded [n, width] array."""
        return pad(self.values, self.starts, self.lengths, width)
