"""Paused jobs in dispatch: which jobs wait, and the queued slots held back for them.

A client pauses a job (collector/completion/control.py writes `jobs/<id>/pause`
and sends JOB_CONTROL); dispatch holds the job's queued items back: they are
marked out in their segment's queue (not offered, as a leased slot is not)
and kept here, per job, as (segment, slots). Items on lease finish with their
worker; one reclaimed while its job is paused is held when a take meets it.
Resume gives the slots back: unmarked, and the segment's cursor rewound to
the first of them, as a reclaim does. The marks outlive a restart: dispatch
reads them at start (`paused_marks`) and holds the items as takes meet them.

A take meets a paused job's items in `free_slots`: it looks at up to
HOLD_SCAN free slots at a time, holds those of paused jobs and goes on until
it has slots of other jobs or reaches the written end, so a long run of a
paused job's items ahead in a segment costs one vectorised pass per
HOLD_SCAN slots, never a worker's request each.

Memory: 8 bytes per held item (its slot), only while its job is paused.
"""

from __future__ import annotations

import numpy as np

from gpu.dispatch.batch import read_rows
from gpu.dispatch.segment_queue import SegmentQueue
from pipeline.core import item_seq
from pipeline.store.job_files import JobFiles
from pipeline.store.segment_format import CHECKSUM_WORD, slot_checksums

HOLD_SCAN = 4096  # free slots looked at per step while some job is paused


def paused_marks(data_root, log) -> set[int]:
    """Job numbers with a pause mark and no `finished` mark (pipeline/store/job_files.py)."""
    found = set()
    for mark, job_no in JobFiles(data_root).paused_running():
        if job_no is None:
            log.warning("unreadable pause mark %s; ignored", mark)
        else:
            found.add(job_no)
    return found


class PausedJobs:
    """The paused job numbers and, per job, the slots held back (segment id, slots)."""

    def __init__(self) -> None:
        self.jobs: set[int] = set()
        self._held: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._per_segment: dict[int, int] = {}  # segment id -> slots held there

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def of(self, seqs: np.ndarray) -> np.ndarray:
        """Per item seq: is its job paused?"""
        return np.isin(item_seq.job_of(seqs), np.fromiter(self.jobs, np.int64))

    def hold(self, segment_id: int, slots: np.ndarray, seqs: np.ndarray) -> None:
        """Keep these slots (all of paused jobs) until their job is resumed or cancelled."""
        jobs = item_seq.job_of(seqs).astype(np.int64)
        for job_no in np.unique(jobs).tolist():
            mine = slots[jobs == job_no]
            self._held.setdefault(int(job_no), []).append((segment_id, mine))
        self._per_segment[segment_id] = self._per_segment.get(segment_id, 0) + len(slots)

    def held_in(self, segment_id: int) -> int:
        """Slots held back in the segment (they wait: the queue depth counts them)."""
        return self._per_segment.get(segment_id, 0)

    @property
    def held(self) -> int:
        """Slots held back, across segments (the metric fabric_paused_items)."""
        return sum(self._per_segment.values())

    def release(self, job_no: int) -> list[tuple[int, np.ndarray]]:
        """The job's held slots, per segment, no longer held."""
        released = self._held.pop(job_no, [])
        for segment_id, slots in released:
            left = self._per_segment.get(segment_id, 0) - len(slots)
            if left > 0:
                self._per_segment[segment_id] = left
            else:
                self._per_segment.pop(segment_id, None)
        return released


def free_slots(
    paused: PausedJobs, work: SegmentQueue, budget: int, start: int | None
) -> tuple[np.ndarray, int]:
    """Up to `budget` free slots of `work` from `start` (None: its cursor) not of a paused
    job, and how far that scanned (SegmentQueue.candidates). A paused job's slots met on
    the way are held; a slot that fails its checksum is not (the take quarantines it)."""
    if not paused:
        return work.candidates(budget, start)
    while True:
        slots, scanned_to = work.candidates(max(budget, HOLD_SCAN), start)
        if not len(slots):
            return slots, scanned_to
        words = read_rows(work.segment.words, slots)
        work.segment.release_slots(int(slots[0]), int(slots[-1]))
        seqs = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        held = paused.of(seqs) & (slot_checksums(words) == words[:, CHECKSUM_WORD])
        if held.any():
            work.mark_out(slots[held])
            paused.hold(work.segment.segment_id, slots[held], seqs[held])
        rest = slots[~held]
        if len(rest) > budget:
            return rest[:budget], int(rest[budget - 1]) + 1
        if len(rest):
            return rest, scanned_to
        start = scanned_to  # all held: look further
