"""What the dispatch file has heard of the lease table (invariant 11).

The dispatch state decides leases; the dispatch file (gpu/dispatch/file.py)
records them so a restarted dispatch of the same broker life does not send
again what is out. `LeaseRecorder` keeps the two in step: a lease is
recorded when it goes out or is adopted from a worker's claims, its dropped
slots and its end are recorded once it was recorded, and the file is
compacted to the live leases when it is mostly garbage.
"""

from __future__ import annotations

from pathlib import Path

from gpu.dispatch.batch import Batch
from gpu.dispatch.file import DispatchFile
from gpu.dispatch.file_format import Lease
from gpu.dispatch.state import DispatchState

COMPACT_GARBAGE_RATIO = 0.75  # compact when more of the file than this is garbage, and
# it is bigger than [dispatch] compact_min_bytes


class LeaseRecorder:
    """Opens the dispatch file (`reloaded`: the leases of this broker life still out)."""

    def __init__(
        self, path: Path, epoch: int, state: DispatchState, compact_min_bytes: int
    ) -> None:
        self.state = state
        self.compact_min_bytes = compact_min_bytes
        self.file, self.reloaded = DispatchFile.open(path, epoch)
        self.recorded: set[int] = {lease.batch_id for lease in self.reloaded}

    def record(self, batch: Batch) -> None:
        """A lease went out (or was adopted): record it, once."""
        if batch.batch_id not in self.recorded:
            self.file.lease(batch.batch_id, batch.session, batch.items)
            self.recorded.add(batch.batch_id)

    def record_ended(self) -> None:
        """Record the slots dropped from leases and the leases ended since the last call."""
        for batch_id, slots in self.state.take_dropped():
            if batch_id in self.recorded:
                self.file.drop(batch_id, slots)
        for batch_id in self.state.take_ended():
            if batch_id in self.recorded:
                self.recorded.discard(batch_id)
                self.file.drop(batch_id)

    def maybe_compact(self) -> None:
        if (
            self.file.garbage_ratio > COMPACT_GARBAGE_RATIO
            and self.file.file_bytes > self.compact_min_bytes
        ):
            self.file.compact([Lease(b.batch_id, b.session, b.items) for b in self.state.leases()])
