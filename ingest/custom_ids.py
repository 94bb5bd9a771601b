"""The custom_ids seen in one job, as 128-bit digests in sorted numpy runs.

A Python `set` of the id strings costs about 100 bytes per id (the str
object plus the table slot), 100 MB per million items. This set keeps only a
128-bit BLAKE2b digest per id, two uint64 columns sorted by hi:
16 bytes per id at rest, 16 MB per million, and about 35 bytes per id for a
moment while the two largest runs merge. Digests are stable across
processes (unlike `hash()`), so the runs can be saved with the job.

Two different ids share a digest with probability about n**2 / 2**129
(about 1e-21 for a billion ids); such a pair would be reported as a
duplicate. Runs merge like a binary counter (a run merges with the one
before it while that is no more than twice its size, in linear time), so
`add` over n ids costs O(n log n) in total and a lookup touches O(log n)
runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


class CustomIdSet:
    """Which custom_ids a job has already used; `add` answers and records in one step."""

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (hi, lo), sorted by hi
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held by the digest runs."""
        return sum(hi.nbytes + lo.nbytes for hi, lo in self._runs)

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
        known = np.zeros(n, dtype=bool)  # in sorted order; sorted needles search faster
        for run_hi, run_lo in self._runs:
            known |= _members(run_hi, run_lo, hi_sorted, lo_sorted)
        repeated[order] = known
        repeated[order[1:][same_as_previous]] = True
        fresh = ~known
        fresh[1:] &= ~same_as_previous
        if fresh.any():
            self._runs.append((hi_sorted[fresh], lo_sorted[fresh]))
            self._count += int(fresh.sum())
            self._merge()
        return repeated

    def contains(self, custom_ids: Sequence[str], *, digests: Digests | None = None) -> np.ndarray:
        """A bool mask, True where an id is already in the set; records nothing."""
        n = len(digests[0]) if digests is not None else len(custom_ids)
        found = np.zeros(n, dtype=bool)
        if n and self._runs:
            hi, lo = digests if digests is not None else _digests(custom_ids)
            order = np.argsort(hi)  # sorted needles search much faster
            hi_sorted, lo_sorted = hi[order], lo[order]
            known = np.zeros(n, dtype=bool)
            for run_hi, run_lo in self._runs:
                known |= _members(run_hi, run_lo, hi_sorted, lo_sorted)
            found[order] = known
        return found

    def _merge(self) -> None:
        while len(self._runs) >= 2 and self._runs[-2][0].size <= 2 * self._runs[-1][0].size:
            b = self._runs.pop()
            a = self._runs.pop()
            self._runs.append(_merged(*a, *b))
            del a, b


Digests = tuple[np.ndarray, np.ndarray]


def digests(custom_ids: Sequence[str]) -> Digests:
    """The (hi, lo) digest columns of `custom_ids`, to hash once and use several times."""
    return _digests(custom_ids)


def _digests(custom_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 columns (hi, lo) of each id's 128-bit BLAKE2b digest of its UTF-8 bytes."""
    blob = b"".join(
        hashlib.blake2b(cid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        for cid in custom_ids
    )
    pairs = np.frombuffer(blob, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def _merged(
    a_hi: np.ndarray, a_lo: np.ndarray, b_hi: np.ndarray, b_lo: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One run from two, in linear time: b's rows go where searchsorted puts them in a."""
    total = a_hi.size + b_hi.size
    at = np.searchsorted(a_hi, b_hi, side="right") + np.arange(b_hi.size)
    from_a = np.ones(total, dtype=bool)
    from_a[at] = False
    hi = np.empty(total, dtype=np.uint64)
    lo = np.empty(total, dtype=np.uint64)
    hi[at], lo[at] = b_hi, b_lo
    hi[from_a], lo[from_a] = a_hi, a_lo
    return hi, lo


def _members(run_hi: np.ndarray, run_lo: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """True where (hi, lo) is in the run (sorted by hi; rows with equal hi in any order)."""
    last = run_hi.size - 1
    left = np.searchsorted(run_hi, hi)
    at = np.minimum(left, last)
    found = (run_hi[at] == hi) & (run_lo[at] == lo)
    tied = ~found & (left < last) & (run_hi[np.minimum(left + 1, last)] == hi)
    for i in np.flatnonzero(tied).tolist():  # two ids share the high 64 bits: about never
        right = int(np.searchsorted(run_hi, hi[i], side="right"))
        found[i] = bool((run_lo[left[i] : right] == lo[i]).any())
    return found
