"""Item batches and appenders shared by the segment log benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.store.datadir import DataDir
from pipeline.store.segment_append import SegmentAppender, SegmentIds
from pipeline.store.segment_format import KIND_INPUT, SegmentKey

SEGMENT_BYTES = 256 << 20  # the broker's default segment size
MIB = 1 << 20


def token_pool(rng: np.random.Generator, items: int, lane: int, pool: int) -> list[np.ndarray]:
    """`pool` random [items, lane] uint32 token batches, built before anything is timed."""
    return [rng.integers(0, 30_000, (items, lane), dtype=np.uint32) for _ in range(pool)]


def open_appender(root: Path, lane: int, slot_bytes: int) -> SegmentAppender:
    """An appender for one input-log key in a fresh data dir at `root`."""
    data_dir = DataDir(root).ensure()
    key = SegmentKey(KIND_INPUT, "bench", shape=1, lane=lane)
    return SegmentAppender(data_dir, key, slot_bytes, SEGMENT_BYTES, SegmentIds(data_dir))


def seconds_to_mb(volume_bytes: int, seconds: list[float]) -> tuple[float, ...]:
    """MB/s (10**6 bytes) for each timing of `volume_bytes`."""
    return tuple(volume_bytes / s / 1e6 for s in seconds)
