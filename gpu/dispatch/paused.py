"""Paused jobs in dispatch: which jobs wait, and the queued slots held back for them.

A client pauses a job (collector/completion/control.py writes `jobs/<id>/pause`
and sends JOB_CONTROL); dispatch holds the job's queued items back: they are
marked out in their segment's queue (not offered, as a leased slot is not)
and kept here, per job, as (segment, slots). Items on lease finish with their
worker; one reclaimed while its job is paused is held when a take meets it.
Resume gives the slots back: unmarked, and the segment's cursor rewound to
the first of them, as a reclaim does. The marks outlive a restart: dispatch
reads them at start (`paused_marks`) and holds the items as takes meet them.

Memory: 8 bytes per held item (its slot), only while its job is paused.
"""

from __future__ import annotations

import numpy as np

from pipeline.core import item_seq
from pipeline.store.job_files import JobFiles


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
