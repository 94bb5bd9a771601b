"""How dispatch learns of queued work: the segment files, the writers' APPENDED, a rescan.

Three ways, so that nothing durable is missed (docs/dispatch.md, what dispatch
knows): at start, every input segment in `segments/` that is not finished
(its LIVE slots, invariant 4); after each writer fsync, an APPENDED notice
with the segment's new written end; and every RESCAN_S a rescan that opens
segments not known yet and, for a segment whose notice is overdue (lost while
dispatch restarted), reads the header's entry count. A segment that cannot be
read is named in `damaged` (status, metrics) and never dispatched from.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

from gpu.dispatch.arrivals import Arrivals
from gpu.dispatch.state import DispatchState
from pipeline.core.errors import FabricError
from pipeline.store.datadir import DataDir
from pipeline.store.intern_table import InternTable
from pipeline.store.salvage import isolated_files
from pipeline.store.scan import SegmentSummary, scan_segment
from pipeline.store.segment import Segment

RESCAN_S = 1.0


class WorkFinder:
    """Feeds `state` the input segments and their written ends; `arrivals` when each became
    durable (the queue's age). Time is the caller's monotonic `now`; arrival stamps are wall
    clock (compared with the wall clock in the metrics only)."""

    def __init__(
        self,
        data_dir: DataDir,
        state: DispatchState,
        arrivals: Arrivals,
        shapes: InternTable,
        counts: collections.Counter,
        log: logging.Logger,
    ) -> None:
        self.data_dir = data_dir
        self.state = state
        self.arrivals = arrivals
        self.shapes = shapes
        self.counts = counts
        self.log = log
        self.damaged: dict[str, str] = {}  # file name -> what is wrong (status, metrics)
        self._scanned: set[int] = set()  # segments looked at and not queued (damaged, finished)
        self._notified: dict[int, float] = {}  # segment -> last APPENDED notice (monotonic)

    def rescan(self, now: float, not_before: float = 0.0) -> None:
        """Open input segments not known yet; refresh the written end of known ones."""
        for path in isolated_files(
            self.data_dir
        ):  # moved aside at start (pipeline/store/salvage.py)
            self.damaged.setdefault(path.name, "isolated in damaged/")
        for path in sorted(self.data_dir.segments.glob("in-*.seg")):
            try:
                segment_id = int(path.name[3:15])
            except ValueError:
                continue
            if self.state.knows(segment_id) or segment_id in self._scanned:
                continue
            self._load(path, not_before)
        for segment in self.state.segments():  # a notice lost while this stage was down
            if now - self._notified.get(segment.segment_id, 0.0) > 2 * RESCAN_S:
                self.state.extend(segment.segment_id, segment.entries)
                self.arrivals.seen(segment.segment_id, segment.entries, time.time())

    def appended(self, segment_id: int, end: int, now: float) -> None:
        """A writer's APPENDED: slots up to `end` of the segment are durable."""
        if not self.state.knows(segment_id):
            for path in self.data_dir.segments.glob(f"in-{segment_id:012d}.*.seg"):
                self._load(path, 0.0)
        if self.state.knows(segment_id):
            self._notified[segment_id] = now
            self.state.extend(segment_id, end)
            self.arrivals.seen(segment_id, end, time.time())
            self.counts["appended_notices"] += 1

    def _load(self, path: Path, not_before: float) -> None:
        summary = scan_segment(path)
        if not isinstance(summary, SegmentSummary):  # damaged: isolated at the next start
            self.log.error("not dispatching from %s: %s", path, summary.reason)
            self.damaged[path.name] = summary.code
            self._scanned.add(int(path.name[3:15]))
            return
        if summary.first_live < 0 and summary.sealed:
            self._scanned.add(summary.header.segment_id)  # finished: the collector's
            return
        try:
            segment = Segment.open(path, writable=True)
        except (FabricError, OSError) as exc:
            self.log.error("cannot open %s for dispatch: %s", path, exc)
            return
        shape = self.shapes.get(segment.key.shape) if segment.key.shape else None
        priority = int((shape or {}).get("priority", 0) or 0)
        first = summary.first_live if summary.first_live >= 0 else summary.end
        self.state.add_segment(
            segment, first, max(summary.end, segment.entries), priority, not_before
        )
        created_s = segment.header.created_ns / 1e9  # found on disk: as old as its segment
        self.arrivals.seen(segment.segment_id, max(summary.end, segment.entries), created_s)
