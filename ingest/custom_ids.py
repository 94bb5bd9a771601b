"""The custom_ids seen in one job, as 128-bit digests in sorted numpy runs.

A Python `set` of the id strings costs about 100 bytes per id (the str
object plus the table slot), 100 MB per million items. This set keeps only a
128-bit digest per id (ingest/id_digest.py, vectorised), two uint64 columns
sorted by hi, and for each run an index of where each range of hi values
starts (one int64 per 8 to 16 ids): about 17 bytes per id at rest, 17 MB
per million, and about 40 bytes per id for a moment while the two largest
runs merge. Digests are deterministic (unlike `hash()`), so they agree
between processes; they live only in memory (the job journal keeps the ids).

Two different ids share a digest with probability about n**2 / 2**129
(about 1e-21 for a billion ids); such a pair would be reported as a
duplicate. Runs merge like a binary counter (a run merges with the one
before it while that is no more than twice its size; the merge is one
stable sort of the two runs back to back, which finds them and merges them
in linear time), so `add` over n ids costs O(n log n) in total and a lookup
touches O(log n) runs.

A lookup does not binary-search the whole run (about 20 dependent, mostly
cache-missing probes per id in a run of a million): hi is uniform, so its
top bits name a bucket of the run's index, and the search runs inside that
bucket, a few steps for every id of the batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ingest.id_digest import str_digests

IDS_PER_BUCKET = 8  # at least; at most twice that (buckets are a power of two)


@dataclass(frozen=True, eq=False)
class _Run:
    hi: np.ndarray  # uint64, sorted
    lo: np.ndarray  # uint64, aligned with hi
    starts: np.ndarray  # int64: bucket b holds rows starts[b]:starts[b + 1]
    shift: int  # bucket of a digest: hi >> shift (64: one bucket)

    @classmethod
    def of(cls, hi: np.ndarray, lo: np.ndarray) -> _Run:
        bits = max(0, int(hi.size // IDS_PER_BUCKET).bit_length() - 1)
        starts = np.zeros((1 << bits) + 1, dtype=np.int64)
        if bits:
            counts = np.bincount((hi >> np.uint64(64 - bits)).astype(np.intp), minlength=1 << bits)
            np.cumsum(counts, out=starts[1:])
        else:
            starts[1] = hi.size
        return cls(hi, lo, starts, 64 - bits)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + self.starts.nbytes

    def members(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """True where (hi, lo) is in the run (rows with equal hi in any order)."""
        last = self.hi.size - 1
        if self.shift < 64:
            bucket = (hi >> np.uint64(self.shift)).astype(np.intp)
            left, right = self.starts[bucket], self.starts[bucket + 1]
        else:
            left, right = np.zeros(hi.size, np.int64), np.full(hi.size, self.hi.size, np.int64)
        while True:  # the first row >= hi in left:right, for every needle at once
            open_ = left < right
            if not open_.any():
                break
            mid = (left + right) >> 1
            less = self.hi[np.minimum(mid, last)] < hi
            left = np.where(open_ & less, mid + 1, left)
            right = np.where(open_ & ~less, mid, right)
        at = np.minimum(left, last)
        found = self.hi[at] == hi
        if not found.any():  # the usual case: no id of the batch is in this run
            return found
        found &= self.lo[at] == lo
        tied = ~found & (left < last) & (self.hi[np.minimum(left + 1, last)] == hi)
        for i in np.flatnonzero(tied).tolist():  # two ids share the high 64 bits: about never
            stop = int(np.searchsorted(self.hi, hi[i], side="right"))
            found[i] = bool((self.lo[left[i] : stop] == lo[i]).any())
        return found


class CustomIdSet:
    """Which custom_ids a job has already used; `add` answers and records in one step."""

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held by the digest runs and their indexes."""
        return sum(run.nbytes for run in self._runs)

    def add(self, custom_ids: Sequence[str], *, digests: Digests | None = None) -> np.ndarray:
        """Record `custom_ids`; return a bool mask, True where an id was already used.

        "Already used" means earlier in this call or in any earlier call, so
        of several equal ids the first is False and the others True. Pass
        `digests` (from `digests()`) when they were computed already.
        """
        hi, lo = digests if digests is not None else _digests(custom_ids)
        n = len(hi)
        repeated = np.zeros(n, dtype=bool)
        if n == 0:
            return repeated
        order = np.lexsort((lo, hi))  # stable: equal ids keep their input order
        hi_sorted, lo_sorted = hi[order], lo[order]
        same_as_previous = (hi_sorted[1:] == hi_sorted[:-1]) & (lo_sorted[1:] == lo_sorted[:-1])
        known = np.zeros(n, dtype=bool)
        for run in self._runs:
            known |= run.members(hi_sorted, lo_sorted)
        repeated[order] = known
        repeated[order[1:][same_as_previous]] = True
        fresh = ~known
        fresh[1:] &= ~same_as_previous
        if fresh.any():
            self._runs.append(_Run.of(hi_sorted[fresh], lo_sorted[fresh]))
            self._count += int(fresh.sum())
            self._merge()
        return repeated

    def add_new(self, digests: Digests) -> None:
        """Record ids known to be in neither the set nor each other, without looking them up.

        The front's recheck (ingest/chunk_check.py) has checked a chunk's ids
        against the set, the job's other chunks in flight and each other before
        its commit records them; a second lookup here would double the set's cost.
        """
        hi, lo = digests
        if len(hi):
            order = np.argsort(hi)
            self._runs.append(_Run.of(hi[order], lo[order]))
            self._count += len(hi)
            self._merge()

    def contains(self, custom_ids: Sequence[str], *, digests: Digests | None = None) -> np.ndarray:
        """A bool mask, True where an id is already in the set; records nothing."""
        n = len(digests[0]) if digests is not None else len(custom_ids)
        found = np.zeros(n, dtype=bool)
        if n and self._runs:
            hi, lo = digests if digests is not None else _digests(custom_ids)
            for run in self._runs:
                found |= run.members(hi, lo)
        return found

    def _merge(self) -> None:
        while len(self._runs) >= 2 and self._runs[-2].hi.size <= 2 * self._runs[-1].hi.size:
            b = self._runs.pop()
            a = self._runs.pop()
            self._runs.append(_merged(a, b))
            del a, b


Digests = tuple[np.ndarray, np.ndarray]


def digests(custom_ids: Sequence[str]) -> Digests:
    """The (hi, lo) digest columns of `custom_ids`, to hash once and use several times."""
    return _digests(custom_ids)


def _digests(custom_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 columns (hi, lo) of each id's 128-bit digest of its UTF-8 bytes."""
    return str_digests(custom_ids)


def _merged(a: _Run, b: _Run) -> _Run:
    """One run from two: a stable sort of a's rows then b's (timsort merges the two runs)."""
    hi = np.concatenate([a.hi, b.hi])
    order = np.argsort(hi, kind="stable")
    return _Run.of(hi[order], np.concatenate([a.lo, b.lo])[order])
