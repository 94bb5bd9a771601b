"""One chunk of checked input: the accepted items as numpy columns, and the bad lines.

Item i of a chunk (0 <= i < n_items) is:

| field                    | meaning                                                    |
|--------------------------|------------------------------------------------------------|
| `line[i]`                | its 1-based line number in the input (uint64)              |
| `custom_ids[i]`          | its custom_id                                              |
| `models[model_index[i]]` | the model it names                                         |
| `shapes[shape_index[i]]` | its canonical `Shape` (endpoint and shape parameters)      |
| `tokens[offsets[i]:offsets[i + 1]]` | its token ids (uint32); empty while it awaits tokenising |

`models` and `shapes` hold each distinct value once, in first-seen order
(after items are dropped they may name a value no remaining item uses).
Items whose prompt is text are listed in `text_items` (positions, ascending)
with their prompts in `texts` (a string, or for chat a tuple of (role,
content) pairs); `ingest.tokenize.tokenize_chunk` turns them into tokens and
returns a chunk with `text_items` empty. `errors` holds one `LineError` per
bad line, in line order. Lines first_line..last_line were read for this
chunk; those neither items nor errors were blank.

A line with k > 1 parts (ingest.line_parser) is k consecutive items, one per
part in part order, all with its line number. `item_index` gives each item's
index in the job: line - 1 for a line's first part, and for parts 1..k-1
consecutive indexes from `PART_BASE` (pipeline/core/item_seq.py), given in
reading order across the whole file; `fanout` lists (line, k, index of part
1, n) for each such line, n the samples of each of its prompts (parts
i * n .. i * n + n - 1 share prompt i; 1 unless the request set `n`). A chunk without fan-out has `item_index` None (every
index is line - 1) and `fanout` empty. Dropping an item drops its whole line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ingest.line_errors import LineError
from ingest.line_parser import ParsedLine
from ingest.line_prompts import TextPrompt
from ingest.request_shape import Shape
from pipeline.core.item_seq import PART_BASE
from pipeline.core.ragged import offsets_of, scatter

Fanout = tuple[tuple[int, int, int, int], ...]  # (line, parts, index of part 1, n) per line


def fanout_entry(values) -> tuple[int, int, int, int]:
    """A fan-out entry from its record form `[line, k, first]` or `[line, k, first, n]`."""
    line, k, first, *rest = values
    return int(line), int(k), int(first), int(rest[0]) if rest else 1


def fanout_record(entry: tuple[int, int, int, int]) -> list[int]:
    """The record form of a fan-out entry: `n` written only when above 1, so a journal or
    message without samples reads the same to an older reader."""
    line, k, first, n = entry
    return [line, k, first] if n == 1 else [line, k, first, n]


@dataclass(frozen=True, slots=True, eq=False)
class TokenGroup:
    """Token ids for some items of a chunk: item `items[j]` gets tokens[offsets[j]:offsets[j+1]]."""

    items: np.ndarray  # int64 item positions
    tokens: np.ndarray  # uint32
    offsets: np.ndarray  # int64, len(items) + 1, starting at 0


@dataclass(frozen=True, slots=True, eq=False)
class InputChunk:
    """Accepted items (numpy columns) and error records of lines first_line..last_line."""

    index: int
    first_line: int
    last_line: int
    line: np.ndarray
    custom_ids: tuple[str, ...]
    models: tuple[str, ...]
    model_index: np.ndarray
    shapes: tuple[Shape, ...]
    shape_index: np.ndarray
    tokens: np.ndarray
    offsets: np.ndarray
    text_items: np.ndarray
    texts: tuple[TextPrompt, ...]
    errors: tuple[LineError, ...]
    item_index: np.ndarray | None = None  # int64 per item; None: line - 1 for each
    fanout: Fanout = ()

    @property
    def n_items(self) -> int:
        return len(self.custom_ids)

    @property
    def indexes(self) -> np.ndarray:
        """Each item's index in its job (int64)."""
        if self.item_index is None:
            return self.line.astype(np.int64) - 1
        return self.item_index

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per item (uint32); 0 for an item still awaiting tokenising."""
        return np.diff(self.offsets).astype(np.uint32)

    @property
    def needs_tokenizing(self) -> bool:
        return len(self.texts) > 0

    def with_tokens(self, groups: Sequence[TokenGroup]) -> InputChunk:
        """This chunk with the tokens of `groups` (which must cover `text_items`) filled in."""
        lengths = np.diff(self.offsets)
        for group in groups:
            lengths[group.items] = np.diff(group.offsets)
        offsets = offsets_of(lengths)
        tokens = np.empty(int(offsets[-1]), dtype=np.uint32)
        ready = np.ones(self.n_items, dtype=bool)
        ready[self.text_items] = False
        had = np.flatnonzero(ready)
        scatter(tokens, offsets[had], self.tokens, self.offsets[had], self.offsets[had + 1])
        for group in groups:
            starts = group.offsets[:-1]
            scatter(tokens, offsets[group.items], group.tokens, starts, group.offsets[1:])
        empty = np.zeros(0, dtype=np.int64)
        return replace(self, tokens=tokens, offsets=offsets, text_items=empty, texts=())

    def without(
        self, drop: np.ndarray, errors: Sequence[LineError], whole_lines: bool = True
    ) -> InputChunk:
        """This chunk less the items where `drop` is True (with `whole_lines`, and the other
        parts of their lines), with `errors` added (line order)."""
        merged = tuple(sorted((*self.errors, *errors), key=lambda e: e.line))
        if not drop.any():
            return replace(self, errors=merged)
        if self.fanout and whole_lines:
            drop = np.isin(self.line, self.line[drop])
        keep = np.flatnonzero(~drop)
        offsets = offsets_of(np.diff(self.offsets)[keep])
        tokens = np.empty(int(offsets[-1]), dtype=np.uint32)
        scatter(tokens, offsets[:-1], self.tokens, self.offsets[keep], self.offsets[keep + 1])
        new_position = np.cumsum(~drop) - 1
        text_keep = ~drop[self.text_items]
        return replace(
            self,
            line=self.line[keep],
            custom_ids=tuple(self.custom_ids[i] for i in keep.tolist()),
            model_index=self.model_index[keep],
            shape_index=self.shape_index[keep],
            tokens=tokens,
            offsets=offsets,
            text_items=new_position[self.text_items[text_keep]],
            texts=tuple(t for t, k in zip(self.texts, text_keep.tolist(), strict=True) if k),
            errors=merged,
            item_index=None if self.item_index is None else self.item_index[keep],
        )


def fanout_indexes(line: np.ndarray, fanout: Fanout) -> np.ndarray | None:
    """The item indexes that `fanout` gives items on (non-decreasing) lines `line`, or None
    when they disagree (a fan-out line present with other than its k items, or a line
    repeated that is not a fan-out line)."""
    line = np.asarray(line, dtype=np.int64)
    index = line - 1
    counts = np.ones(len(line), dtype=np.int64)
    for number, k, first, _ in fanout:
        lo, hi = np.searchsorted(line, [number, number + 1])
        if hi == lo:
            continue  # the line was dropped (rejected)
        if hi - lo != k or k < 2 or first < PART_BASE:
            return None
        index[lo + 1 : hi] = np.arange(first, first + k - 1)
        counts[lo:hi] = 0
    repeated = np.flatnonzero(np.diff(line) == 0)
    if len(repeated) and counts[repeated + 1].any():
        return None
    return index


@dataclass(slots=True)
class ChunkBuilder:
    """Collects one chunk's accepted lines and errors, then `build`s the numpy columns."""

    index: int
    first_line: int
    next_part: int = PART_BASE  # the part-region index the next fan-out line's part 1 takes
    line: list[int] = field(default_factory=list)
    custom_ids: list[str] = field(default_factory=list)
    model_index: list[int] = field(default_factory=list)
    shape_index: list[int] = field(default_factory=list)
    token_arrays: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    text_items: list[int] = field(default_factory=list)
    texts: list[TextPrompt] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    item_index: list[int] = field(default_factory=list)
    fanout: list[tuple[int, int, int, int]] = field(default_factory=list)
    _models: dict[str, int] = field(default_factory=dict)
    _shapes: dict[Shape, int] = field(default_factory=dict)

    def add(self, line: int, item: ParsedLine) -> None:
        """Add the line's parts as items (one item for a line of one part)."""
        if item.part_count == 1:
            self._add(line, item.custom_id, item.model, item.shape, item.text, item.token_ids)
            self.item_index.append(line - 1)
            return
        parts = item.parts()
        self.fanout.append((line, len(parts), self.next_part, item.n))
        self.item_index.append(line - 1)
        self.item_index.extend(range(self.next_part, self.next_part + len(parts) - 1))
        self.next_part += len(parts) - 1
        for shape, text, token_ids in parts:
            self._add(line, item.custom_id, item.model, shape, text, token_ids)

    def _add(self, line, custom_id, model, shape, text, token_ids) -> None:
        position = len(self.line)
        self.line.append(line)
        self.custom_ids.append(custom_id)
        self.model_index.append(self._models.setdefault(model, len(self._models)))
        self.shape_index.append(self._shapes.setdefault(shape, len(self._shapes)))
        if token_ids is not None:
            self.token_arrays.append(token_ids)
            self.lengths.append(token_ids.size)
        else:
            self.lengths.append(0)
            self.text_items.append(position)
            self.texts.append(text)

    def build(self, last_line: int) -> InputChunk:
        offsets = offsets_of(np.array(self.lengths, dtype=np.int64))
        tokens = np.concatenate(self.token_arrays) if self.token_arrays else np.zeros(0, np.uint32)
        return InputChunk(
            index=self.index,
            first_line=self.first_line,
            last_line=last_line,
            line=np.array(self.line, dtype=np.uint64),
            custom_ids=tuple(self.custom_ids),
            models=tuple(self._models),
            model_index=np.array(self.model_index, dtype=np.uint32),
            shapes=tuple(self._shapes),
            shape_index=np.array(self.shape_index, dtype=np.uint32),
            tokens=tokens,
            offsets=offsets,
            text_items=np.array(self.text_items, dtype=np.int64),
            texts=tuple(self.texts),
            errors=tuple(sorted(self.errors, key=lambda e: e.line)),
            item_index=np.array(self.item_index, dtype=np.int64) if self.fanout else None,
            fanout=tuple(self.fanout),
        )
