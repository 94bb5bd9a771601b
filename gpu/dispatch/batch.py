"""What dispatch hands a worker, and what leaves dispatch without a result.

A `Batch` is one segment's items, read and checked as one copy of their
slots (`read_rows`), described to the worker and to completion as
`ITEM_DTYPE` items (`items_of`). An `Outcome` gathers the items that leave
dispatch other than by a result: dead letters, quarantined and cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu.work_protocol import ITEM_DTYPE
from pipeline import item_seq


@dataclass(eq=False)
class Batch:
    """What a worker gets: one segment's items, ready for the engine."""

    batch_id: int
    session: str
    segment_id: int
    model: str
    shape: int
    lane: int
    items: np.ndarray  # ITEM_DTYPE
    lengths: np.ndarray  # uint32
    tokens: np.ndarray  # uint32 [n, lane]: a view of `slots`
    deadline_s: float
    slots: np.ndarray | None = None  # uint32 [n, slot words]: the slots as read (sent as is)
    suspect: bool = False  # one item on its last try: its session gets nothing else meanwhile
    started: bool = True  # the worker may have started it (False once a report says queued)
    answered: bool = False  # its results passed through dispatch (retire pending)
    handed_s: float = 0.0  # monotonic: when it was handed out (or adopted)


@dataclass(eq=False)
class Outcome:
    """Items that left dispatch other than by a result: for the completion stage."""

    dead_letters: np.ndarray  # ITEM_DTYPE, reclaimed max_attempts times
    quarantined: np.ndarray  # ITEM_DTYPE, checksum failed
    cancelled: np.ndarray  # ITEM_DTYPE, queued items of a cancelled job


def names_itself(words: np.ndarray) -> np.ndarray:
    """True for each slot whose header agrees with itself (pipeline/item_seq.py: consistent)."""
    seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
    job = np.ascontiguousarray(words[:, 2:4]).view("<u8").reshape(-1)
    return item_seq.consistent(seq, job, words[:, 4])


def items_of(segment_id: int, slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    items = np.zeros(len(slots), ITEM_DTYPE)
    items["segment"] = segment_id
    items["slot"] = slots
    items["seq"] = seqs
    return items


def read_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index] as a new array; one memcpy when the index is a contiguous run."""
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == len(index):
        return rows[first : last + 1].copy()
    return rows[index]
