"""The segment collector: removes finished segment files, never one in use.

A segment is finished when it is sealed and none of its slots is LIVE (for
the completion log: every result delivered). Every process that opens a
segment holds a shared `flock` on it (see pipeline.store.segment.Segment); the
collector removes a file only while it holds the exclusive lock, taken
without blocking, and after checking the markers again under that lock.
A file in use stays pending and is tried again on a later step.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.store.durable import fsync_dir
from pipeline.store.job_files import JOB_ID, JobFiles
from pipeline.store.scan import SegmentSummary, scan_segment
from pipeline.store.segment_format import (
    DELETED_OFFSET,
    ENTRIES_OFFSET,
    HEADER_BYTES,
    SEALED_NS_OFFSET,
    SEALED_OFFSET,
)

log = logging.getLogger("fabric.collector")


@dataclass
class CollectResult:
    removed: list[Path] = field(default_factory=list)
    in_use: list[Path] = field(default_factory=list)
    not_finished: list[Path] = field(default_factory=list)


class SegmentCollector:
    """Removes finished segments offered to it; retries those in use on each step."""

    def __init__(self, retry_s: float = 5.0) -> None:
        self.retry_s = retry_s
        self._pending: set[Path] = set()
        self._next_try_s = 0.0

    @property
    def pending(self) -> frozenset[Path]:
        return frozenset(self._pending)

    def offer(self, segments: list[SegmentSummary] | list[Path]) -> CollectResult:
        """Try to remove these segments now; those in use stay pending."""
        paths = [s.path if isinstance(s, SegmentSummary) else Path(s) for s in segments]
        result = CollectResult()
        for path in paths:
            outcome = self.remove_if_finished(path)
            getattr(result, outcome).append(path)
            if outcome == "in_use":
                self._pending.add(path)
            else:
                self._pending.discard(path)
        return result

    def next_step_s(self) -> float | None:
        """When `step` next has something to do (None: nothing pending)."""
        return self._next_try_s if self._pending else None

    def step(self, now_s: float) -> CollectResult:
        """Retry pending removals, at most once every `retry_s`."""
        if not self._pending or now_s < self._next_try_s:
            return CollectResult()
        self._next_try_s = now_s + self.retry_s
        return self.offer(sorted(self._pending))

    def sweep(self, data_dir, retention_s: float) -> CollectResult:
        """Offer every finished segment on disk: input segments at once; completion segments
        (every result delivered) once their job finished `retention_s` ago.

        A job has finished when every item has a result: the completion stage then
        writes the job's `finished` mark (pipeline/store/job_files.py), which retention counts from.
        """
        candidates = []
        now_ns = time.time_ns()
        finished: dict[str, int | None] = {}
        jobs = JobFiles(data_dir.root)
        for path in data_dir.segment_files():
            try:
                with open(path, "rb") as f:
                    header = f.read(HEADER_BYTES)
                sealed = struct.unpack_from("<I", header, SEALED_OFFSET)[0]
                entries = struct.unpack_from("<Q", header, ENTRIES_OFFSET)[0]
                deleted = struct.unpack_from("<Q", header, DELETED_OFFSET)[0]
                sealed_ns = struct.unpack_from("<Q", header, SEALED_NS_OFFSET)[0]
            except (OSError, struct.error):
                continue
            if not sealed or deleted < entries:
                continue
            if path.parent == data_dir.completion:
                job = path.name.split(".")[1]
                if job not in finished:
                    finished[job] = jobs.finished_ns(job) if JOB_ID.match(job) else None
                done_ns = finished[job]
                if done_ns is None or now_ns - max(done_ns, sealed_ns) < retention_s * 1e9:
                    continue
            candidates.append(path)
        return self.offer(candidates) if candidates else CollectResult()

    def remove_if_finished(self, path: Path) -> str:
        """Remove `path` if finished and unused; returns removed, in_use or not_finished."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "removed"
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "in_use"
            try:
                same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                return "removed"
            summary = scan_segment(path)
            if not same_file or not isinstance(summary, SegmentSummary) or not summary.finished:
                log.warning("not removing %s: it is not a finished segment", path)
                return "not_finished"
            path.unlink()
            fsync_dir(path.parent)
            log.info("removed finished segment %s (%d slots retired)", path.name, summary.dead)
            return "removed"
        finally:
            os.close(fd)
