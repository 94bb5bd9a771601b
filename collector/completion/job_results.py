"""One job's part of the completion log, as the completion stage holds it in memory.

Its open appenders (one per size class), its readers (for delivery), the
first undelivered slot of each of its segments, and its exact counters: two
`IndexBitmap`s, the items with a result (or an error result) and the items
with an error result, rebuilt from the job's completion segments when it is
first touched (`CompletionLog.load_job`), never from a stored count; the
number of its results not yet delivered (LIVE slots), counted there and kept
up to date by every store and every delivery, so that a status or a page
never recounts the job's markers and never needs its segments open; and the
job's token totals (`prompt_tokens`, `completion_tokens`) over its results,
each result counted once: added for the results `mark` newly stores, and
rebuilt with the bitmaps from one slot per item. The prompt tokens of
part-region results are also kept per part (`part_prompt`), so that
`prompt_total` can leave out the samples j > 0 of a prompt once the line
table knows them (pipeline/core/line_table.py, `repeats`): OpenAI counts a
prompt once however many samples `n` it asks for.
Indexes in the part region (parts 1.. of fan-out lines, pipeline/core/item_seq.py)
have bitmaps of their own, at index - PART_BASE; `line_counts` folds the
items into lines with the job's line table.
"""

from __future__ import annotations

import numpy as np

from pipeline.core.index_bitmap import ItemIndexSet
from pipeline.core.item_seq import PART_BASE
from pipeline.core.line_table import LineTable
from pipeline.store.segment import Segment
from pipeline.store.segment_append import SegmentAppender


class JobResults:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.appenders: dict[int, SegmentAppender] = {}  # size class -> its open segment
        self.results = ItemIndexSet()  # the items with a result or an error result
        self.failed = ItemIndexSet()  # those with an error result
        self.readers: dict[int, Segment] = {}  # completion segment id -> a handle for delivery
        self.first_undelivered: dict[int, int] = {}  # per completion segment: all before delivered
        self.segments_changed = True  # the directory may hold segments `readers` lacks
        self.undelivered = 0  # LIVE slots in its completion segments: counted at load, kept since
        self.prompt_tokens = 0  # over the results (not error results) stored
        self.completion_tokens = 0  # generated tokens over those results
        self.part_prompt = np.zeros(0, np.uint32)  # at index - PART_BASE: its prompt tokens

    def add_tokens(self, prompt: np.ndarray, completion: np.ndarray, index: np.ndarray) -> None:
        """Count the token totals of results just stored (each result once) for items
        `index`."""
        self.prompt_tokens += int(prompt.sum(dtype=np.int64))
        self.completion_tokens += int(completion.sum(dtype=np.int64))
        index = np.asarray(index, dtype=np.int64)
        high = np.flatnonzero(index >= PART_BASE)
        if len(high):
            at = index[high] - PART_BASE
            need = int(at.max()) + 1
            if need > len(self.part_prompt):
                grown = np.zeros(max(need, 2 * len(self.part_prompt)), np.uint32)
                grown[: len(self.part_prompt)] = self.part_prompt
                self.part_prompt = grown
            self.part_prompt[at] = prompt[high]

    def prompt_total(self, table: LineTable | None) -> int:
        """The job's prompt tokens, each prompt once: its results' prompt tokens less those of
        the parts `table` knows as repeated samples (a part it does not know yet counts)."""
        if table is None or not len(table) or not len(self.part_prompt):
            return self.prompt_tokens
        stored = np.flatnonzero(self.part_prompt) + PART_BASE
        repeats = stored[table.repeats(stored)] - PART_BASE
        return self.prompt_tokens - int(self.part_prompt[repeats].sum(dtype=np.int64))

    def mark(self, index: np.ndarray, failed: np.ndarray | None = None) -> None:
        """Items `index` have a result; those where `failed` is True an error result."""
        index = np.asarray(index, dtype=np.int64)
        self.results.add(index)
        if failed is not None:
            self.failed.add(index[failed])

    def seen(self, index: np.ndarray) -> np.ndarray:
        """True for each item that has a result already."""
        return self.results.has(index)

    @property
    def completed(self) -> int:
        """Distinct items with a result or an error result."""
        return self.results.count()

    @property
    def failures(self) -> int:
        return self.failed.count()

    def line_counts(self, table: LineTable | None) -> tuple[int, int]:
        """(lines done, lines failed): a line is done when every part has a result or an
        error result, and failed when it is done and any part has an error result."""
        results, failures = self.results, self.failed
        done, failed = results.lines.count(), failures.lines.count()
        if table is None or not len(table):
            return done, failed
        lines = table.lines
        all_done = table.done(results)
        first_failed = failures.lines.has(lines)
        any_failed = table.failed(failures)
        done -= int((results.lines.has(lines) & ~all_done).sum())
        failed += int((all_done & any_failed).sum()) - int(first_failed.sum())
        return done, failed

    def lines_done(self, table: LineTable, lines: np.ndarray) -> np.ndarray:
        """True for each of fan-out `lines` whose every part has a result."""
        return table.done(self.results, lines)
