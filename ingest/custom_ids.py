"""The custom_ids seen in one job, as 128-bit digests in sorted numpy runs.

A Python `set` of the id strings costs about 100 bytes per id (the str
object plus the table slot), 100 MB per million items. This set keeps only a
128-bit digest per id (ingest/id_digest.py, vectorised), two uint64 columns
sorted by hi, and for each run an index of where each range of hi values
starts (one int64 per 8 to 16 ids), and a prefilter (8 to 16 bits per id,
below): about 18 bytes per id at rest, 18 MB per million, and about 40
bytes per id for a moment while the largest runs merge. Digests are
deterministic (unlike `hash()`), so they agree between processes; they live
only in memory (the job journal keeps the ids).

Two different ids share a digest with probability about n**2 / 2**129
(about 1e-21 for a billion ids); such a pair would be reported as a
duplicate. Runs merge like a counter in base MERGE_FAN_IN (the last
MERGE_FAN_IN runs merge into one while the first of them is no more than
twice the size of the last; the merge is one stable sort of the runs back
to back, which finds them and merges them), so `add` over n ids moves each
id about log4(n / batch) times, O(n log n) in total, and a lookup touches
O(log n) runs. (Two at a time, the merges cost the front about 0.5 us per
id in a job of a million; four at a time, about a third of that.)

A lookup does not binary-search the whole run (about 20 dependent, mostly
cache-missing probes per id in a run of a million): hi is uniform, so its
top bits name a bucket of the run's index, and the search runs inside that
bucket, a few steps for every id of the batch at once.

Most ids looked up are new (a job's ids are unique), and a search in every
run cost the front about 0.5 us per id in a job of a million. So the set
also keeps a prefilter: one bit per value of hi's top bits, set for every id
added, with FILTER_BITS_PER_ID to twice that many bits per id. A
clear bit says "not in the set" for sure; only the ids whose bit is set (all
that are in the set, and 1 in 8 to 16 of those that are not) are searched
for in the runs. When the set outgrows it the filter doubles (or more) and is
rebuilt from the runs, which are sorted by hi, so a rebuild is linear.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ingest.id_digest import str_digests

IDS_PER_BUCKET = 8  # at least; at most twice that (buckets are a power of two)
FILTER_BITS_PER_ID = 8  # at least: 6% to 12% of the ids not in the set pass the prefilter
FILTER_MIN_BITS = 12  # log2 of the smallest prefilter (4096 bits)
MERGE_FAN_IN = 4  # runs merged at once
DIRECT_SEARCH_MAX = 512  # fewer ids than this: one binary search each beats the bucket loop


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
        if hi.size < DIRECT_SEARCH_MAX:  # a few (the prefilter's hits): the loop's cost is fixed
            left = np.searchsorted(self.hi, hi)
        else:
            left = self._first_at_least(hi)
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

    def _first_at_least(self, hi: np.ndarray) -> np.ndarray:
        """The first row >= hi, searched inside each needle's bucket, all needles at once."""
        last = self.hi.size - 1
        if self.shift < 64:
            bucket = (hi >> np.uint64(self.shift)).astype(np.intp)
            left, right = self.starts[bucket], self.starts[bucket + 1]
        else:
            left, right = np.zeros(hi.size, np.int64), np.full(hi.size, self.hi.size, np.int64)
        while True:
            open_ = left < right
            if not open_.any():
                break
            mid = (left + right) >> 1
            less = self.hi[np.minimum(mid, last)] < hi
            left = np.where(open_ & less, mid + 1, left)
            right = np.where(open_ & ~less, mid, right)
        return left


class CustomIdSet:
    """Which custom_ids a job has already used; `add` answers and records in one step."""

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        self._count = 0
        self._filter = _Prefilter(FILTER_MIN_BITS)

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held by the digest runs, their indexes and the prefilter."""
        return sum(run.nbytes for run in self._runs) + self._filter.words.nbytes

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
        known = self._members(hi_sorted, lo_sorted)
        repeated[order] = known
        repeated[order[1:][same_as_previous]] = True
        fresh = ~known
        fresh[1:] &= ~same_as_previous
        if fresh.any():
            self._append(_Run.of(hi_sorted[fresh], lo_sorted[fresh]))
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
            self._append(_Run.of(hi[order], lo[order]))

    def contains(self, custom_ids: Sequence[str], *, digests: Digests | None = None) -> np.ndarray:
        """A bool mask, True where an id is already in the set; records nothing."""
        n = len(digests[0]) if digests is not None else len(custom_ids)
        if n and self._runs:
            hi, lo = digests if digests is not None else _digests(custom_ids)
            return self._members(hi, lo)
        return np.zeros(n, dtype=bool)

    def _members(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """True where (hi, lo) is in the set: the runs searched only for the filter's hits."""
        found = np.zeros(len(hi), dtype=bool)
        if not self._runs:
            return found
        maybe = np.flatnonzero(self._filter.may_hold(hi))
        if len(maybe):
            hi, lo = hi[maybe], lo[maybe]
            hits = np.zeros(len(maybe), dtype=bool)
            for run in self._runs:
                hits |= run.members(hi, lo)
            found[maybe] = hits
        return found

    def _append(self, run: _Run) -> None:
        """Add a run of ids not in the set; grow the prefilter when the set outgrows it."""
        self._runs.append(run)
        self._count += run.hi.size
        wanted = max(FILTER_MIN_BITS, (self._count * FILTER_BITS_PER_ID - 1).bit_length())
        if wanted > self._filter.bits:
            self._filter = _Prefilter(wanted)
            for each in self._runs:
                self._filter.add_sorted(each.hi)
        else:
            self._filter.add_sorted(run.hi)
        self._merge()

    def _merge(self) -> None:
        k = MERGE_FAN_IN
        while len(self._runs) >= k and self._runs[-k].hi.size <= 2 * self._runs[-1].hi.size:
            last = self._runs[-k:]
            del self._runs[-k:]
            self._runs.append(_merged(last))
            del last


class _Prefilter:
    """One bit per value of the top `bits` bits of hi: set for every id added (no false
    negatives; a set bit may be another id's)."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.shift = np.uint64(64 - bits)
        self.words = np.zeros(1 << (bits - 6), dtype=np.uint64)

    def add_sorted(self, hi: np.ndarray) -> None:
        """Set the bits of `hi` (sorted: equal words are adjacent, so one OR per word)."""
        if not hi.size:
            return
        at = hi >> self.shift
        word = (at >> np.uint64(6)).astype(np.intp)
        bit = np.left_shift(np.uint64(1), at & np.uint64(63))
        starts = np.flatnonzero(np.diff(word, prepend=-1))
        self.words[word[starts]] |= np.bitwise_or.reduceat(bit, starts)

    def may_hold(self, hi: np.ndarray) -> np.ndarray:
        """False where an id of this high half was surely never added."""
        at = hi >> self.shift
        word = self.words[(at >> np.uint64(6)).astype(np.intp)]
        return (word >> (at & np.uint64(63))) & np.uint64(1) != 0


Digests = tuple[np.ndarray, np.ndarray]


def digests(custom_ids: Sequence[str]) -> Digests:
    """The (hi, lo) digest columns of `custom_ids`, to hash once and use several times."""
    return _digests(custom_ids)


def _digests(custom_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 columns (hi, lo) of each id's 128-bit digest of its UTF-8 bytes."""
    return str_digests(custom_ids)


def _merged(runs: list[_Run]) -> _Run:
    """One run from several: a stable sort of their rows back to back (timsort finds the
    sorted runs and merges them)."""
    hi = np.concatenate([run.hi for run in runs])
    order = np.argsort(hi, kind="stable")
    return _Run.of(hi[order], np.concatenate([run.lo for run in runs])[order])
