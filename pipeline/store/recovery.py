"""Recovery: rebuild the queue from the segment markers, and nothing else.

Run by the supervisor before any stage starts (invariant 4). It lists the
segment files of both logs, scans their marker columns in parallel (a process
pool sized to the cores, used once there are 4 segments per process: below
that, starting the pool costs more than it saves), cuts torn tails, recounts and rewrites every
header, and seals every segment it finds (writers append only to segments
they create in their own life). Persisted offsets and counters are never
read to decide anything.

It returns one summary per segment: LIVE count, first LIVE slot, finished or
not. Files that are not readable segments are reported and left untouched;
no stage uses them. Orphan temporary files (a creation interrupted by a
crash, never acknowledged) are removed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.store.datadir import DataDir
from pipeline.store.scan import DamagedFile, SegmentSummary, scan_segment

log = logging.getLogger("fabric.recovery")
# Starting a pool costs about as much as scanning a few segments serially.
POOL_MIN_SEGMENTS_PER_PROCESS = 4


@dataclass
class RecoveryReport:
    """What recovery found and did."""

    segments: list[SegmentSummary] = field(default_factory=list)
    damaged: list[DamagedFile] = field(default_factory=list)
    removed_temp: list[Path] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def finished(self) -> list[SegmentSummary]:
        """Segments that are sealed and fully retired: the collector's to remove."""
        return [s for s in self.segments if s.finished]

    @property
    def dispatchable(self) -> list[SegmentSummary]:
        """Segments with LIVE slots, oldest first."""
        return [s for s in self.segments if s.live]

    @property
    def live(self) -> int:
        return sum(s.live for s in self.segments)

    def torn(self) -> int:
        return sum(len(s.torn) for s in self.segments)


def _repair(path: Path) -> SegmentSummary | DamagedFile:
    return scan_segment(path, repair=True)


def recover(data_dir: DataDir, processes: int = 0) -> RecoveryReport:
    """Scan and repair every segment of `data_dir`; `processes` 0 means one per core.

    The caller holds the data dir's exclusive lock.
    """
    started = time.perf_counter()
    data_dir.ensure()
    report = RecoveryReport()
    for tmp in data_dir.temp_files():
        tmp.unlink(missing_ok=True)
        report.removed_temp.append(tmp)
        log.warning("removed orphan temporary file %s (segment creation interrupted)", tmp)
    paths = data_dir.segment_files()
    workers = min(processes or os.cpu_count() or 1, len(paths) // POOL_MIN_SEGMENTS_PER_PROCESS)
    if workers > 1:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_repair, paths, chunksize=max(1, len(paths) // (workers * 4))))
    else:
        results = [_repair(path) for path in paths]
    for result in results:
        if isinstance(result, DamagedFile):
            report.damaged.append(result)
            log.error("segment quarantined, not served: %s", result.reason)
            continue
        report.segments.append(result)
        if result.torn:
            log.warning(
                "%s: cut torn tail of %d unacknowledged slot(s) from slot %d",
                result.path.name,
                len(result.torn),
                result.torn[0],
            )
    report.elapsed_s = time.perf_counter() - started
    log.info(
        "recovered %d segments in %.3f s: %d live items, %d finished segments, %d damaged files",
        len(report.segments),
        report.elapsed_s,
        report.live,
        len(report.finished),
        len(report.damaged),
    )
    return report
