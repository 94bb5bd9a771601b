"""One job's part of the completion log, as the completion stage holds it in memory.

Its open appenders (one per size class), its readers (for delivery), the
first undelivered slot of each of its segments, and its exact counters: two
`IndexBitmap`s, the items with a result (or an error result) and the items
with an error result, rebuilt from the job's completion segments when it is
first touched (`CompletionLog.load_job`), never from a stored count; and the
job's token totals (`prompt_tokens`, `completion_tokens`) over its results,
each result counted once: added for the results `mark` newly stores, and
rebuilt with the bitmaps from one slot per item.
"""

from __future__ import annotations

import numpy as np

from pipeline.index_bitmap import IndexBitmap
from pipeline.segment import Segment
from pipeline.segment_append import SegmentAppender


class JobResults:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.appenders: dict[int, SegmentAppender] = {}  # size class -> its open segment
        self.has_result = IndexBitmap()
        self.failed = IndexBitmap()
        self.readers: dict[int, Segment] = {}  # completion segment id -> a handle for delivery
        self.first_undelivered: dict[int, int] = {}  # per completion segment: all before delivered
        self.segments_changed = True  # the directory may hold segments `readers` lacks
        self.prompt_tokens = 0  # over the results (not error results) stored
        self.completion_tokens = 0  # generated tokens over those results

    def add_tokens(self, prompt: np.ndarray, completion: np.ndarray) -> None:
        """Count the token totals of results just stored (each result once)."""
        self.prompt_tokens += int(prompt.sum(dtype=np.int64))
        self.completion_tokens += int(completion.sum(dtype=np.int64))

    def mark(self, index: np.ndarray, failed: np.ndarray | None = None) -> None:
        """Items `index` have a result; those where `failed` is True an error result."""
        self.has_result.add(index)
        if failed is not None:
            self.failed.add(index[failed])

    def seen(self, index: np.ndarray) -> np.ndarray:
        """True for each item that has a result already."""
        return self.has_result.has(index)

    @property
    def completed(self) -> int:
        """Distinct items with a result or an error result."""
        return self.has_result.count()

    @property
    def failures(self) -> int:
        return self.failed.count()
