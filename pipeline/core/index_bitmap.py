"""A set of item indexes kept as a bitmap: one bool per index, grown by doubling.

Completion's exact counters (the items of a job that have a result, those
that have an error result) and the vector sink's (the items of a job it has
stored) are such sets. They are rebuilt from what is on disk, never from a
stored count, so they count distinct items however often one arrives. The
set's size is kept as indexes are added (only the indexes not in it yet
count, each once), so `count` is free: a status or a results page asks it
for every answer, and summing the bitmap each time was quadratic in the
job's size. `ItemIndexSet` keeps a job's item indexes in two such bitmaps, one
for lines and one for fan-out parts (pipeline/core/item_seq.py).
"""

from __future__ import annotations

import numpy as np

from pipeline.core.item_seq import PART_BASE


class IndexBitmap:
    """Item indexes 0 .. 2**32 - 1 (int arrays), present or not."""

    __slots__ = ("bits", "size")

    def __init__(self, size: int = 1024) -> None:
        self.bits = np.zeros(size, dtype=bool)
        self.size = 0  # distinct indexes in the set: count()

    def add(self, index: np.ndarray) -> None:
        """Put these indexes in the set (the bitmap grows to hold the largest)."""
        index = np.asarray(index, dtype=np.int64)
        if not len(index):
            return
        top = int(index.max())
        if top >= len(self.bits):
            grown = np.zeros(max(top + 1, 2 * len(self.bits)), dtype=bool)
            grown[: len(self.bits)] = self.bits
            self.bits = grown
        fresh = index[~self.bits[index]]
        if not len(fresh):
            return
        self.bits[fresh] = True
        if len(fresh) > 1 and not (fresh[1:] > fresh[:-1]).all():
            fresh = np.unique(fresh)  # an index twice in one call counts once
        self.size += len(fresh)

    def has(self, index: np.ndarray) -> np.ndarray:
        """True for each index in the set (False for any past the bitmap's end)."""
        index = np.asarray(index, dtype=np.int64)
        inside = index < len(self.bits)
        out = np.zeros(len(index), dtype=bool)
        out[inside] = self.bits[index[inside]]
        return out

    def count(self) -> int:
        """How many distinct indexes are in the set."""
        return self.size


class ItemIndexSet:
    """A job's item indexes (pipeline/core/item_seq.py), present or not: a line's own index
    (below PART_BASE) in `lines`, a fan-out part's in `parts` at index - PART_BASE. One bitmap
    over both regions would be 2**31 bools (2 GiB) as soon as a job has a second part."""

    __slots__ = ("lines", "parts")

    def __init__(self) -> None:
        self.lines = IndexBitmap()
        self.parts = IndexBitmap()

    def add(self, index: np.ndarray) -> None:
        index = np.asarray(index, dtype=np.int64)
        high = index >= PART_BASE
        if high.any():
            self.parts.add(index[high] - PART_BASE)
            index = index[~high]
        self.lines.add(index)

    def has(self, index: np.ndarray) -> np.ndarray:
        """True for each index in the set."""
        index = np.asarray(index, dtype=np.int64)
        high = index >= PART_BASE
        if not high.any():
            return self.lines.has(index)
        out = np.zeros(len(index), dtype=bool)
        out[~high] = self.lines.has(index[~high])
        out[high] = self.parts.has(index[high] - PART_BASE)
        return out

    def count(self) -> int:
        """How many distinct indexes are in the set, lines' and parts' together."""
        return self.lines.count() + self.parts.count()
