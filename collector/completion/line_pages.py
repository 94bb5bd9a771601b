"""Delivery of fan-out lines whole: a page read from the completion log, made of whole lines.

`read_page` (collector/completion/pages.py) reads results in completion-log
order, so the parts of a fan-out line (docs/completion.md, "Lines and
parts") may be spread over pages or not all stored yet. `whole_lines` turns
such a page into one of whole lines:

* a row of a fan-out line that is not done yet (some part has no result) is
  left out: it stays LIVE and comes with its line later (`ready_rows` lets
  `read_page` skip such rows before reading them);
* a done fan-out line brings every part, also parts not in the page (read
  by index from the job's completion segments, even when already marked
  delivered: a crash between marking one segment and the next leaves a line
  half marked, and the client must still get it whole; its files keep each
  custom_id once);
* with `everything` (reading all from cursors, never marking), a fan-out
  line is given only by the page that holds its part 0, so it is not
  written twice.

The page's `index` becomes each row's line index (line - 1) and `part` its
part, which the client's join (collector/delivery/join.py) orders by; `item`
keeps each row's own item index (the vector sink's ids are item seqs).
The `prompt_tokens` of a row that is a sample j > 0 of its prompt (a line
with n > 1, pipeline/core/line_table.py `repeats`) is 0: the join sums its rows'
usage, and OpenAI counts a prompt once however many samples it asks for.
Acknowledging the page marks every row's slot delivered, so a line is
marked whole.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from collector.completion.job_results import JobResults
from collector.completion.pages import Page, page_of_slots
from pipeline.core.line_table import LineTable
from pipeline.store.segment import Segment
from pipeline.store.segment_format import EMPTY, STATE_MASK


def ready_rows(job: JobResults, table: LineTable) -> Callable[[np.ndarray], np.ndarray]:
    """`read_page`'s filter: True for an item that may go now, i.e. not a part of a fan-out
    line that is not done yet, nor a part the table does not know yet. Such rows stay LIVE
    unread (read, checksummed and dropped on every page, they cost completion twice the
    reading of the same rows one per line)."""
    done_lines = table.lines[table.done(job.results)]

    def ready(index: np.ndarray) -> np.ndarray:
        line, _ = table.owner(index)
        fanned = np.isin(line, table.lines)
        return np.where(fanned, np.isin(line, done_lines), line >= 0)

    return ready


def whole_lines(
    page: Page,
    job: JobResults,
    readers: dict[int, Segment],
    table: LineTable,
    everything: bool,
    limit: int,
) -> Page:
    """`page` with only whole lines, each part's row carrying its line index and part. Unless
    `everything`, the fan-out lines given are cut to about `limit` rows in all (at least one
    line), in the order they first appear in the page; the rest wait for the next page."""
    line, part = table.owner(page.index)
    fanned = np.isin(line, table.lines)
    keep = ~fanned & (line >= 0)  # a part the table does not know yet waits for it
    wanted_lines = np.zeros(0, np.int64)
    if fanned.any():
        lines, first_row = np.unique(line[fanned], return_index=True)
        lines = lines[np.argsort(first_row, kind="stable")]  # in page order
        done = job.lines_done(table, lines)
        if everything:  # only the page holding part 0 gives the line
            done &= np.isin(lines, line[fanned & (part == 0)])
        wanted_lines = lines[done]
        if not everything:  # (a line cut from an `everything` page would never come again)
            room = max(limit - int(keep.sum()), 1)
            rows = np.cumsum(table.counts(wanted_lines))
            cut = max(1, int(np.searchsorted(rows, room, side="right")))
            wanted_lines = wanted_lines[:cut]
        keep |= fanned & np.isin(line, wanted_lines)
    kept = _select(page, keep)
    if len(wanted_lines):
        missing = np.setdiff1d(table.members(wanted_lines), kept.index.astype(np.int64))
        if len(missing):
            kept = _concat(kept, _read_indexes(readers, missing))
    line, part = table.owner(kept.index)
    repeats = table.repeats(kept.index)
    if repeats.any():  # a prompt counts once in its line's usage, not once per sample
        kept.prompt_tokens = np.where(repeats, 0, kept.prompt_tokens).astype(np.uint32)
    kept.item = kept.index.astype(np.uint32)
    kept.index = np.where(line >= 0, line, kept.index).astype(np.uint32)
    kept.part = part.astype(np.uint32)
    return kept


def _read_indexes(readers: dict[int, Segment], wanted: np.ndarray) -> Page:
    """The stored results of items `wanted` (each once, whatever its marker)."""
    where, parts = [], []
    left = np.asarray(wanted, dtype=np.int64)
    for segment_id in sorted(readers):
        if not len(left):
            break
        seg = readers[segment_id]
        states = seg.markers & STATE_MASK
        index = seg.slots["index"].astype(np.int64)
        slots = np.flatnonzero((states != EMPTY) & np.isin(index, left))
        if len(slots):
            slots = slots[seg.verify(slots)]
            _, first = np.unique(index[slots], return_index=True)
            slots = slots[np.sort(first)]
            left = np.setdiff1d(left, index[slots])
            where.append((segment_id, slots))
            parts.append((seg, slots))
    return page_of_slots(where, parts, {})


def _select(page: Page, keep: np.ndarray) -> Page:
    """The rows of `page` where `keep` is True; `where` keeps only their slots."""
    if keep.all():
        return page
    where, at = [], 0
    for segment_id, slots in page.where:
        mine = keep[at : at + len(slots)]
        at += len(slots)
        if mine.any():
            where.append((segment_id, slots[mine]))
    rows = np.flatnonzero(keep)
    sizes = np.diff(page.offsets)[rows]
    starts = page.offsets[:-1][rows]
    payload = np.concatenate(
        [page.payload[s : s + n] for s, n in zip(starts.tolist(), sizes.tolist(), strict=True)]
        or [np.zeros(0, np.uint8)]
    )
    return Page(
        where,
        page.index[rows],
        page.status[rows],
        page.kind[rows],
        page.model[rows],
        page.shape[rows],
        page.prompt_tokens[rows],
        payload,
        np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        page.next,
    )


def _concat(a: Page, b: Page) -> Page:
    return Page(
        a.where + b.where,
        np.concatenate([a.index, b.index]),
        np.concatenate([a.status, b.status]),
        np.concatenate([a.kind, b.kind]),
        np.concatenate([a.model, b.model]),
        np.concatenate([a.shape, b.shape]),
        np.concatenate([a.prompt_tokens, b.prompt_tokens]),
        np.concatenate([a.payload, b.payload]),
        np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]]),
        a.next,
    )
