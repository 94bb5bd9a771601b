"""Batch ids that are never reused, across dispatch restarts and broker lives.

A worker's `seen_batch` from an earlier life must never cover a batch of this
one, so ids only grow: blocks of BATCH_ID_BLOCK ids are reserved durably in
`<data_dir>/next-batch-id` (pipeline/store/counter.py), each block starting at
least at the wall clock in microseconds since the epoch, so a wall clock
stepped back cannot reuse one. While the disk is full no block can be
reserved, and no batch goes out (tried once a second, logged once).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gpu.dispatch.state import DispatchState
from pipeline.core.errors import DiskFullError
from pipeline.store.counter import DurableCounter
from pipeline.store.disk_full import FullDisk

BATCH_IDS_FILE = "next-batch-id"  # DurableCounter in the data dir: batch ids never reused
BATCH_ID_BLOCK = 1 << 20  # batch ids reserved at a time


class BatchIds:
    """Keeps `state` numbering batches inside a durably reserved block."""

    def __init__(self, data_root: Path, state: DispatchState, log: logging.Logger) -> None:
        self.counter = DurableCounter(data_root / BATCH_IDS_FILE)
        self.disk = FullDisk(log, "no new batches until batch ids can be reserved")
        self.state = state
        self.end = 0
        self._reserve()  # at start a full disk is an error: the stage cannot open

    def ready(self, now: float) -> bool:
        """Whether the next batch has a reserved id (reserving the next block if needed)."""
        if self.state.peek_batch_id() < self.end:
            return True
        if not self.disk.ready(now):  # a full disk: tried once a second, logged once
            return False
        try:
            self._reserve()
        except DiskFullError as exc:
            self.disk.failed(exc, now)
            return False
        self.disk.succeeded(now)
        return True

    def _reserve(self) -> None:
        first = self.counter.next(floor=time.time_ns() // 1000, count=BATCH_ID_BLOCK)
        self.state.set_next_batch_id(first - 1)
        self.end = first + BATCH_ID_BLOCK
