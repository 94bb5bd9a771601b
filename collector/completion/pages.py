"""Delivery's side of the completion log: read a job's results back as pages, mark them delivered.

`read_page` gives up to `limit` undelivered results of a job (LIVE slots),
oldest completion segment first, or with `everything` every stored result
from the caller's cursors (completion segment id -> first slot not yet
read). `mark_delivered` writes DEAD markers for a page the client has
acknowledged and syncs them: in the completion log, DEAD means delivered
(invariant 12). A slot that fails its checksum is never sent: it is logged,
and marked delivered so that nothing waits on it for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collector.completion.job_results import JobResults
from collector.completion.record_format import PROMPT_HEADER, split_flags
from pipeline.core.errors import FabricError
from pipeline.core.ragged import offsets_of
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, EMPTY, LIVE, STATE_MASK

log = logging.getLogger("fabric.completion")


@dataclass(eq=False)
class Page:
    """Results read back for delivery, in completion-log order."""

    where: list[tuple[int, np.ndarray]]  # (completion segment id, slots)
    index: np.ndarray  # u4
    status: np.ndarray  # u1
    kind: np.ndarray  # u1
    model: np.ndarray  # u1: id in models.log
    shape: np.ndarray  # u2
    prompt_tokens: np.ndarray  # u4
    payload: np.ndarray  # u1
    offsets: np.ndarray  # i8
    next: dict[int, int]  # completion segment id -> first slot not yet read
    part: np.ndarray | None = None  # u4 per row when the page joins fan-out lines (line_pages)
    item: np.ndarray | None = None  # u4 per row with `part`: the row's own item index

    def __len__(self) -> int:
        return len(self.index)


def open_readers(job: JobResults, paths: list[Path]) -> dict[int, Segment]:
    """Open handles on the job's completion segments (`paths`, listed by the caller only
    when `job.segments_changed`: this process appended results, which may make a segment)."""
    if not job.segments_changed:
        return job.readers
    job.segments_changed = False
    for path in paths:
        segment_id = int(path.name[4:16])
        if segment_id not in job.readers:
            try:
                job.readers[segment_id] = Segment.open(path, writable=True)
            except (FabricError, OSError):
                job.segments_changed = True  # try it again next time
                continue
    return job.readers


def read_page(
    job: JobResults,
    readers: dict[int, Segment],
    limit: int,
    cursors: dict[int, int] | None = None,
    everything: bool = False,
    ready: Callable[[np.ndarray], np.ndarray] | None = None,
    skip: dict[int, np.ndarray] | None = None,
) -> Page:
    """Up to `limit` undelivered results of the job, oldest first; with `everything`,
    delivered ones too, from `cursors` (as returned in `Page.next`). `ready`, when given
    (not with `everything`), says per item index which results may go now: the others stay
    LIVE, unread and uncounted (parts of fan-out lines not done yet, line_pages.py). `skip`
    (not with `everything`): completion segment id -> slots left out, the results of pages
    the client holds and has not acknowledged yet (collector/completion/delivery.py)."""
    cursors = dict(cursors or {})
    where: list[tuple[int, np.ndarray]] = []
    parts = []
    taken = 0
    for segment_id in sorted(readers):
        if taken >= limit:
            break
        seg = readers[segment_id]
        if everything:
            begin = cursors.get(segment_id, 0)
        else:
            begin = job.first_undelivered.get(segment_id, 0)
        states = seg.markers[begin:] & STATE_MASK
        if not everything:  # skip the delivered prefix next time
            undelivered = np.flatnonzero(states != DEAD)
            begin += int(undelivered[0]) if len(undelivered) else len(states)
            job.first_undelivered[segment_id] = begin
            states = seg.markers[begin:] & STATE_MASK
        wanted = (states != EMPTY) if everything else (states == LIVE)
        held = None if everything or not skip else skip.get(segment_id)
        if held is not None and len(held):
            held = held[held >= begin] - begin
            wanted[held[held < len(wanted)]] = False
        slots = np.flatnonzero(wanted) + begin
        if ready is not None and not everything and len(slots):
            slots = slots[ready(seg.slots["index"][slots].astype(np.int64))]
        slots = slots[: limit - taken]
        if not len(slots):
            continue
        cursors[segment_id] = int(slots[-1]) + 1
        ok = seg.verify(slots)
        if not ok.all():  # never sent; marked delivered so nothing waits on it for ever
            bad = slots[~ok]
            log.error(
                "job %s: %d stored result(s) in %s fail their checksum and are lost: slots %s",
                job.job_id,
                len(bad),
                seg.path.name,
                bad[:10].tolist(),
            )
            live = bad[(seg.markers[bad] & STATE_MASK) == LIVE]
            if len(live):
                job.undelivered -= seg.tombstone(live)
                seg.sync()
            slots = slots[ok]
        where.append((segment_id, slots))
        parts.append((seg, slots))
        taken += len(slots)
    return page_of_slots(where, parts, cursors)


def mark_delivered(readers: dict[int, Segment], where: list[tuple[int, np.ndarray]]) -> int:
    """Mark results delivered (DEAD in the completion log) and make that durable."""
    count = 0
    for segment_id, slots in where:
        seg = readers.get(segment_id)
        if seg is None:
            continue
        live = slots[(seg.markers[slots] & STATE_MASK) == LIVE]
        if len(live):
            count += seg.tombstone(live)
            seg.sync()
        if len(slots):
            seg.release_slots(int(slots.min()), int(slots.max()))  # read and delivered
    return count


def page_of_slots(where, parts, next_at) -> Page:
    """The Page of `parts` ((segment, slots), in `where`'s order) read from their slots."""
    if not parts:
        empty = np.zeros(0, np.uint32)
        return Page(
            [],
            empty,
            empty.astype(np.uint8),
            empty.astype(np.uint8),
            empty.astype(np.uint8),
            empty.astype(np.uint16),
            empty,
            np.zeros(0, np.uint8),
            np.zeros(1, np.int64),
            next_at,
        )
    index, flags, counts, bodies = [], [], [], []
    for seg, slots in parts:
        index.append(seg.slots["index"][slots])
        flags.append(seg.slots["flags"][slots])
        count = seg.slots["count"][slots].astype(np.int64)
        counts.append(count)
        width = int(count.max())
        bodies.append((seg.bodies[slots, :width], count))
    index = np.concatenate(index)
    flags = np.concatenate(flags)
    count = np.concatenate(counts)
    prompt = np.concatenate(
        [np.ascontiguousarray(b[:, :PROMPT_HEADER]).view("<u4").reshape(-1) for b, _ in bodies]
    )
    chunks = []
    for body, c in bodies:
        if (c == c[0]).all():  # the usual case: every result the same size, one slice
            chunks.append(body[:, PROMPT_HEADER : int(c[0])].reshape(-1))
            continue
        columns = np.arange(body.shape[1])[None, :]
        mask = (columns >= PROMPT_HEADER) & (columns < c[:, None])
        chunks.append(body[mask])
    payload = np.concatenate(chunks)
    offsets = offsets_of(count - PROMPT_HEADER)
    status, kind, model, shape = split_flags(flags)
    return Page(
        where,
        index.astype(np.uint32),
        status,
        kind,
        model,
        shape,
        prompt.astype(np.uint32),
        payload,
        offsets,
        next_at,
    )
