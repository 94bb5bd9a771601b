"""What dispatch hands a worker, and what leaves dispatch without a result.

A `Batch` is one segment's items, read and checked as one copy of their
slots (`read_rows`), described to the worker and to completion as
`ITEM_DTYPE` items (`items_of`). An `Outcome` gathers the items that leave
dispatch other than by a result: dead letters, quarantined and cancelled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gpu.work_protocol import ITEM_DTYPE
from pipeline.core import item_seq
from pipeline.store.segment_format import COUNT_WORD, SLOT_HEADER_WORDS

if TYPE_CHECKING:
    from gpu.dispatch.segment_queue import SegmentQueue

log = logging.getLogger("fabric.dispatch")


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

    @classmethod
    def of_slots(
        cls,
        batch_id: int,
        session: str,
        work: SegmentQueue,
        slots,
        seqs,
        words,
        lease_s: float,
        suspect: bool,
        now: float,
    ) -> Batch:
        """A batch of `work`'s segment's `slots`, read as `words` (their seqs `seqs`), handed
        out `now` on a lease of `lease_s`."""
        segment, lane = work.segment, work.segment.key.lane
        return cls(
            batch_id=batch_id,
            session=session,
            segment_id=segment.segment_id,
            model=work.model,
            shape=segment.key.shape,
            lane=lane,
            items=items_of(segment.segment_id, slots, seqs),
            lengths=words[:, COUNT_WORD].copy(),
            tokens=words[:, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + lane],  # a view of `words`
            slots=words,
            deadline_s=now + lease_s,
            suspect=suspect,
            handed_s=now,
        )


@dataclass(eq=False)
class Outcome:
    """Items that left dispatch other than by a result: for the completion stage."""

    dead_letters: np.ndarray  # ITEM_DTYPE, reclaimed max_attempts times
    quarantined: np.ndarray  # ITEM_DTYPE, checksum failed
    cancelled: np.ndarray  # ITEM_DTYPE, queued items of a cancelled job


def item_array(message, name: str) -> np.ndarray:
    """The wire.Message's `name` array of (segment, slot, seq) items, empty if absent.

    ValueError (answered with ERROR) unless it is one-dimensional ITEM_DTYPE: a
    worker's arrays are checked here, before any of them indexes a segment.
    """
    items = message.arrays.get(name)
    if items is None:
        return np.zeros(0, ITEM_DTYPE)
    if items.dtype != ITEM_DTYPE or items.ndim != 1:
        raise ValueError(
            f"array {name!r} is {items.dtype.descr} x {list(items.shape)}, "
            f"not one-dimensional {ITEM_DTYPE.descr}"
        )
    return items


def names_itself(words: np.ndarray) -> np.ndarray:
    """True for each slot whose header agrees with itself (pipeline/core/item_seq.py: consistent)."""
    seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
    job = np.ascontiguousarray(words[:, 2:4]).view("<u8").reshape(-1)
    return item_seq.consistent(seq, job, words[:, 4])


def quarantined(segment_id: int, bad: np.ndarray, words: np.ndarray, seqs: np.ndarray):
    """The items of slots `bad` (their `words` and `seqs` as read) that failed their checksum,
    for an error result each; logged. An error result goes to the item a slot names only if
    its header agrees with itself; else no item is blamed: the loss accounting finds it from
    the job's journal (collector/losses.py, `run.py check`)."""
    log.error(
        "segment %d: %d slot(s) fail their checksum and are quarantined: %s",
        segment_id,
        len(bad),
        bad[:10].tolist(),
    )
    said = names_itself(words)
    if not said.all():
        log.error(
            "segment %d: slot(s) %s do not say which item they hold; no error result "
            "sent (run.py check lists the lost items)",
            segment_id,
            bad[~said][:10].tolist(),
        )
    return items_of(segment_id, bad[said], seqs[said])


def items_of(segment_id: int, slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    items = np.zeros(len(slots), ITEM_DTYPE)
    items["segment"] = segment_id
    items["slot"] = slots
    items["seq"] = seqs
    return items


def adopted(
    batch_id: int, session: str, segment, slots: np.ndarray, deadline_s: float, now: float
) -> Batch:
    """The lease for slots a re-registering worker still holds (invariant 8): no tokens are
    sent again, only the items are described."""
    key = segment.key
    return Batch(
        batch_id=batch_id,
        session=session,
        segment_id=segment.segment_id,
        model=key.name,
        shape=key.shape,
        lane=key.lane,
        items=items_of(segment.segment_id, slots, segment.slots["seq"][slots]),
        lengths=np.zeros(0, np.uint32),
        tokens=np.zeros((0, 0), np.uint32),
        deadline_s=deadline_s,
        handed_s=now,
    )


def read_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index] as a new array; one memcpy when the index is a contiguous run."""
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == len(index):
        return rows[first : last + 1].copy()
    return rows[index]
