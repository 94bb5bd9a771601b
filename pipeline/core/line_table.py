"""A job's fan-out lines: which items are the parts of which line, and lines counted from items.

A line of k > 1 parts (docs/completion.md, "Lines and parts") has part 0 at
its own index (line - 1) and parts 1..k-1 at k - 1 consecutive indexes from
`first` in the part region (index >= PART_BASE, pipeline/core/item_seq.py). The
table is folded from the `parts` entries of the job's commit records
(pipeline/store/job_files.py), in reading order, so `first` increases along it.

| column  | meaning |
|---------|---------|
| `line`  | the line's own index (line - 1): its part 0 |
| `count` | k, its parts |
| `first` | the index of its part 1 |
| `n`     | samples of each prompt: parts i*n .. i*n+n-1 are samples of prompt i (an entry without it: 1) |

A sample j > 0 of a prompt (part p with p % n != 0) repeats its prompt:
OpenAI counts a prompt once however many samples it asks for, so the usage
of a line and the job's prompt token totals leave those parts' prompt
tokens out (`repeats`).

A job without fan-out has an empty table, and every count below is then
the item count itself.
"""

from __future__ import annotations

import numpy as np

from pipeline.core.index_bitmap import ItemIndexSet
from pipeline.core.item_seq import PART_BASE


class LineTable:
    """The fan-out lines of one job, appended as its chunks commit."""

    def __init__(self) -> None:
        self._rows: list[tuple[int, int, int]] = []
        self._samples: dict[int, int] = {}  # line index -> n, for lines with n > 1
        self._built: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, parts: list[list[int]]) -> None:
        """Add a commit record's `parts` entries `[line number, k, first]` or
        `[line number, k, first, n]`."""
        for number, k, first, *rest in parts:
            self._rows.append((int(number) - 1, int(k), int(first)))
            if rest and int(rest[0]) > 1:
                self._samples[int(number) - 1] = int(rest[0])
        if parts:
            self._built = None

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(line, count, first, extras, starts), rows sorted by first: `extras` every part-region
        index of the table back to back, `starts` where each row's run of them begins."""
        if self._built is None:
            rows = np.array(sorted(self._rows, key=lambda r: r[2]), dtype=np.int64).reshape(-1, 3)
            line, count, first = rows[:, 0], rows[:, 1], rows[:, 2]
            runs = count - 1
            starts = np.cumsum(runs) - runs
            extras = np.repeat(first - starts, runs) + np.arange(int(runs.sum()))
            self._built = (line, count, first, extras, starts)
        return self._built

    @property
    def lines(self) -> np.ndarray:
        return self._arrays()[0]

    def items(self) -> int:
        """Items of the table's lines (their parts, all together)."""
        return int(self._arrays()[1].sum())

    def owner(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(line index, part) of each item `index`: an index below PART_BASE is its own line's
        part 0; a part-region index not in the table gets line -1."""
        index = np.asarray(index, dtype=np.int64)
        line = index.copy()
        part = np.zeros(len(index), dtype=np.int64)
        high = np.flatnonzero(index >= PART_BASE)
        if len(high):
            rows, count, first = self._arrays()[:3]
            at = np.searchsorted(first, index[high], side="right") - 1
            ok = at >= 0
            ok[ok] &= index[high][ok] < first[at[ok]] + count[at[ok]] - 1
            line[high] = np.where(ok, rows[np.maximum(at, 0)], -1)
            part[high] = np.where(ok, index[high] - first[np.maximum(at, 0)] + 1, 0)
        return line, part

    def repeats(self, index: np.ndarray) -> np.ndarray:
        """True for each item `index` that is a sample j > 0 of its prompt (its line has
        n > 1 and its part p has p % n != 0): its prompt tokens are counted with sample 0."""
        index = np.asarray(index, dtype=np.int64)
        out = np.zeros(len(index), dtype=bool)
        if not self._samples:
            return out
        high = np.flatnonzero(index >= PART_BASE)  # part 0 is never a repeat
        if len(high):
            line, part = self.owner(index[high])
            keys = np.fromiter(self._samples, np.int64, len(self._samples))
            values = np.fromiter(self._samples.values(), np.int64, len(self._samples))
            order = np.argsort(keys)
            keys, values = keys[order], values[order]
            at = np.minimum(np.searchsorted(keys, line), len(keys) - 1)
            n = np.where(keys[at] == line, values[at], 1)
            out[high] = part % n != 0
        return out

    def counts(self, lines: np.ndarray) -> np.ndarray:
        """The parts of each of fan-out `lines` (line indexes in the table)."""
        line, count = self._arrays()[:2]
        return count[_rows_of(line, lines)]

    def members(self, lines: np.ndarray) -> np.ndarray:
        """Every item index (part 0 and the part region) of fan-out `lines` (line indexes)."""
        line, count, first = self._arrays()[:3]
        at = _rows_of(line, lines)
        runs = count[at] - 1
        starts = np.cumsum(runs) - runs
        extras = np.repeat(first[at] - starts, runs) + np.arange(int(runs.sum()))
        return np.concatenate([np.asarray(lines, np.int64), extras])

    def done(self, has: ItemIndexSet, lines: np.ndarray | None = None) -> np.ndarray:
        """True for each fan-out line (all, or those `lines`, which must be in the table) whose
        every part is in `has`."""
        line, _, _, extras, starts = self._arrays()
        ok = has.has(line) & np.logical_and.reduceat(has.has(extras), starts)
        return ok if lines is None else ok[_rows_of(line, lines)]

    def failed(self, failed: ItemIndexSet) -> np.ndarray:
        """True for each fan-out line with any part in `failed`."""
        line, _, _, extras, starts = self._arrays()
        return failed.has(line) | np.logical_or.reduceat(failed.has(extras), starts)


def _rows_of(line: np.ndarray, lines: np.ndarray) -> np.ndarray:
    """The table row of each of `lines` (which must be in `line`)."""
    order = np.argsort(line, kind="stable")
    return order[np.searchsorted(line[order], lines)]
