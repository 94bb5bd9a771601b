"""Which items of a chunk are already in the input log (for a chunk retried after a failure).

A chunk that was accepted but never committed (a stage or the broker died,
or the front gave up waiting) may have some of its items in the log. Its
retry must store only the others. An item's seq joins its job and index
(pipeline/core/item_seq.py), so this reads the seq column of the segments that could hold the chunk:
those still open, or sealed after the chunk was accepted. Only retries pay
for it; the normal path never scans. A chunk's fan-out lines (`n` > 1) have
their parts 1.. in the job's part region, so those indexes are read too
(`stored_by_earlier_try`).
"""

from __future__ import annotations

import numpy as np

from ingest.input_chunk import InputChunk
from pipeline.core.errors import SegmentError
from pipeline.core.item_seq import index_of, seq_range
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.store.segment_format import EMPTY


def stored_indexes(
    data_dir: DataDir, job_no: int, first_index: int, last_index: int, since_ns: int
) -> np.ndarray:
    """Sorted item indexes in first_index..last_index of job `job_no` found in the input log."""
    lo, hi = seq_range(job_no, first_index, last_index)
    found = []
    if not data_dir.segments.is_dir():
        return np.zeros(0, dtype=np.int64)
    for path in sorted(data_dir.segments.glob("in-*.seg")):
        try:
            segment = Segment.open(path)
        except (SegmentError, FileNotFoundError):
            continue  # damaged files are never served; a collected one held nothing live
        try:
            if segment.sealed and segment.sealed_ns < since_ns:
                continue
            written = np.flatnonzero(segment.states() != EMPTY)
            seqs = segment.slots["seq"][written]
            hit = seqs[(seqs >= lo) & (seqs <= hi)]
            found.append(index_of(hit))
        finally:
            segment.close()
    return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def stored_by_earlier_try(
    data_dir: DataDir, job_no: int, chunk: InputChunk, accepted_ns: int
) -> np.ndarray:
    """The item indexes of `chunk` (its fan-out parts included) that a try accepted at
    `accepted_ns` and never committed already stored in the input log."""
    stored = stored_indexes(
        data_dir, job_no, chunk.first_line - 1, chunk.last_line - 1, accepted_ns
    )
    if chunk.fanout:  # parts 1.. of its fan-out lines lie in the part region
        first = min(f[2] for f in chunk.fanout)
        last = max(f[2] + f[1] - 2 for f in chunk.fanout)
        parts = stored_indexes(data_dir, job_no, first, last, accepted_ns)
        stored = np.concatenate([stored, parts])
    return stored
