"""Random item batches and a segment appender for them: what conftest.py gives the tests,
in a module light enough for the crash tests' writer processes (tests/procs/segment_writer.py)
to import without pytest (importing conftest costs a process about 0.3 s of CPU)."""

from __future__ import annotations

import numpy as np

from pipeline.store.datadir import DataDir
from pipeline.store.segment_append import SegmentAppender, SegmentIds
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for

LANE = 64
KEY = SegmentKey(KIND_INPUT, "minilm", shape=1, lane=LANE)
SLOT_BYTES = slot_bytes_for(LANE * 4)


def make_batch(rng: np.random.Generator, n: int, seq0: int, lane: int = LANE):
    """n items with consecutive seqs from seq0 and random token counts up to `lane`."""
    counts = rng.integers(1, lane + 1, n).astype(np.uint32)
    tokens = rng.integers(0, 30_000, (n, lane)).astype(np.uint32)
    tokens[np.arange(lane)[None, :] >= counts[:, None]] = 0
    seq = np.arange(seq0, seq0 + n, dtype=np.uint64)
    job = np.full(n, 7, dtype=np.uint64)
    index = (seq - 1).astype(np.uint32)
    return seq, job, index, counts, tokens


def appender(
    data_dir: DataDir, segment_bytes: int = 1 << 18, idle_s: float = 30.0
) -> SegmentAppender:
    return SegmentAppender(data_dir, KEY, SLOT_BYTES, segment_bytes, SegmentIds(data_dir), idle_s)
