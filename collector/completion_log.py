"""The completion stage's durable path: output, then tombstone, then count (invariant 3).

`CompletionLog.record()` takes a batch of results from a worker and, for
each item, first checks the input slot it answers: a slot already DEAD, or
an item that already has a result in the completion log, is a duplicate
(computation can repeat, observable completion happens once: invariant 5);
a seq that does not match the slot's is refused (a stale or forged result).
The new results are appended to the job's completion segments (the same
segment format, kind 2, keyed by job; the slot's `flags` word says result
(0) or error result (1)) and synced: one fdatasync per touched segment.
Only then are the input markers written DEAD; `flush_tombstones()` makes
them durable about every 100 ms (one fdatasync per touched input segment)
and returns what retired, which is when dispatch may forget the items and
the worker may be acknowledged. Duplicates of items that already have a
result are retired too, so a crash between output and tombstone heals, and
a duplicate whose slot is DEAD already is returned by the next flush again
(dispatch, which sends item errors again until it sees them retired, learns
that a copy it resent after a completion restart is done).

Per job, a bitmap of the item indexes that have a result is the exact
counter: it is rebuilt from the completion log itself (`load_job`), never
from a persisted count, so progress never doubles after a restart. A second
bitmap marks the error results, so `failed` is exact too.

A stored result is `[u32 prompt tokens][payload]`; the slot's `flags` word is
`status | kind << 4 | model << 8 | shape << 16`: status RESULT or
ERROR_RESULT; kind TOKENS, VECTOR or TEXT; the input's model, as its id in
`<data_dir>/models.log` (a table like the shape table; 0 = unknown); and
the input's shape id (0 = none). A job's completion segments
are keyed by (job, size class): a result goes to the smallest class of
SIZE_CLASSES that holds it, so slots fit what the job's outputs need.
A result larger than the largest class becomes an error result saying so.

Delivery reads results back (`page`) and marks them delivered (`delivered`):
in the completion log, DEAD means delivered (invariant 12).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.datadir import DataDir
from pipeline.errors import FabricError
from pipeline.segment import Segment
from pipeline.segment_append import SegmentAppender, SegmentIds
from pipeline.segment_format import (
    DEAD,
    EMPTY,
    KIND_COMPLETION,
    LIVE,
    STATE_MASK,
    SUFFIX,
    SegmentKey,
    slot_bytes_for,
)
from router.shapes import ShapeTable

log = logging.getLogger("fabric.completion")
RESULT = 0
ERROR_RESULT = 1
TOKENS = 0  # generated token ids, little-endian u32
VECTOR = 1  # an embedding, little-endian f32
TEXT = 2  # UTF-8: an error's "code: message"
PROMPT_HEADER = 4
SIZE_CLASSES = (256, 1024, 4096, 16384, 65536, 262144, 1 << 20)  # stored bytes per result
# A job's completion segment of one size class: the first holds FIRST_SEGMENT_BYTES' worth of
# slots or the items the job still expects (if more), the next twice the last, up to
# segment_bytes. A small job gets a small file; a large one reaches full size.
FIRST_SEGMENT_BYTES = 256 * 1024


STATUS_MASK = 0x0F
MODELS_FILE = "models.log"


def flags_of(status, kind, model=0, shape=0) -> np.ndarray:
    """The flags word of stored results (numpy arrays or scalars)."""
    return (
        np.asarray(status, np.uint32)
        | (np.asarray(kind, np.uint32) << np.uint32(4))
        | (np.minimum(np.asarray(model, np.uint32), 0xFF) << np.uint32(8))
        | (np.minimum(np.asarray(shape, np.uint32), 0xFFFF) << np.uint32(16))
    )


@dataclass(eq=False)
class Results:
    """One worker batch of results, all for one job."""

    job_id: str
    job_no: int
    segment: np.ndarray  # u8 per item: the input segment
    slot: np.ndarray  # u4
    seq: np.ndarray  # u8
    status: np.ndarray  # u4: RESULT or ERROR_RESULT, optionally | kind << 4
    payload: np.ndarray  # u1, every item's bytes back to back
    offsets: np.ndarray  # i8, n + 1
    prompt_tokens: np.ndarray | None = None  # u4 per item


@dataclass(eq=False)
class Recorded:
    stored: int  # new results made durable
    duplicates: int  # already DEAD, or already had a result
    refused: list[str]  # one line per refused item (seq mismatch, never written)


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

    def __len__(self) -> int:
        return len(self.index)


def _grow(bits: np.ndarray, top: int) -> np.ndarray:
    if top < len(bits):
        return bits
    grown = np.zeros(max(top + 1, 2 * len(bits)), dtype=bool)
    grown[: len(bits)] = bits
    return grown


class _Job:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.appenders: dict[int, SegmentAppender] = {}
        self.has_result = np.zeros(1024, dtype=bool)
        self.failed = np.zeros(1024, dtype=bool)
        self.readers: dict[int, Segment] = {}
        self.first_undelivered: dict[int, int] = {}  # per completion segment: all before delivered
        self.segments_changed = True  # the directory may hold segments `readers` lacks
        self.last_result_ns = 0

    def mark(self, index: np.ndarray, failed: np.ndarray | None = None) -> None:
        if len(index):
            top = int(index.max())
            self.has_result = _grow(self.has_result, top)
            self.failed = _grow(self.failed, top)
            self.has_result[index] = True
            if failed is not None:
                self.failed[index[failed]] = True

    def seen(self, index: np.ndarray) -> np.ndarray:
        inside = index < len(self.has_result)
        out = np.zeros(len(index), dtype=bool)
        out[inside] = self.has_result[index[inside]]
        return out

    @property
    def completed(self) -> int:
        """Distinct items with a result or an error result."""
        return int(self.has_result.sum())

    @property
    def failures(self) -> int:
        return int(self.failed.sum())


class CompletionLog:
    """Owned by the completion stage; `open_input(segment_id)` gives a writable input segment."""

    def __init__(
        self,
        data_dir: DataDir,
        open_input: Callable[[int], Segment],
        segment_bytes: int = 64 << 20,
        expected_items: Callable[[str], int] = lambda job_id: 0,
    ) -> None:
        self.data_dir = data_dir
        self.models = ShapeTable(data_dir.root, MODELS_FILE)
        self.open_input = open_input
        self.segment_bytes = segment_bytes
        self.expected_items = expected_items  # job id -> items known so far (a sizing hint)
        self.ids = SegmentIds(data_dir)
        self._jobs: dict[str, _Job] = {}
        self._pending: dict[int, list[np.ndarray]] = defaultdict(
            list
        )  # input segment -> slots marked DEAD, not yet synced
        self._to_retire: list[tuple[int, np.ndarray]] = []  # written, output not yet synced
        self._dirty: set[SegmentAppender] = set()

    def _paths(self, job_id: str) -> list[Path]:
        return sorted(self.data_dir.completion.glob(f"out-*.{job_id}.s0.l*{SUFFIX}"))

    def load_job(self, job_id: str) -> _Job:
        """The job's state, rebuilt from its completion segments on first use."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        job = _Job(job_id)
        for path in self._paths(job_id):
            with Segment.open(path) as seg:
                if seg.key.name != job_id:
                    continue
                written = np.flatnonzero(seg.states() != EMPTY)
                good = written[seg.verify(written)]
                flags = seg.slots["flags"][good]
                job.mark(
                    seg.slots["index"][good].astype(np.int64),
                    (flags & np.uint32(STATUS_MASK)) == ERROR_RESULT,
                )
        self._jobs[job_id] = job
        return job

    def known_jobs(self) -> list[str]:
        return list(self._jobs)

    def completed(self, job_id: str) -> int:
        """Distinct items of the job with a result (or an error result)."""
        return self.load_job(job_id).completed

    def failed(self, job_id: str) -> int:
        """Distinct items of the job with an error result."""
        return self.load_job(job_id).failures

    def _appender(self, job: _Job, size_class: int) -> SegmentAppender:
        appender = job.appenders.get(size_class)
        if appender is None:
            key = SegmentKey(KIND_COMPLETION, job.job_id, 0, size_class)
            slot_bytes = slot_bytes_for(size_class)
            appender = SegmentAppender(
                self.data_dir,
                key,
                slot_bytes,
                max(self.segment_bytes, 4096 * 3 + 64 * slot_bytes),
                self.ids,
                min_bytes=FIRST_SEGMENT_BYTES,
            )
            job.appenders[size_class] = appender
        return appender

    def record(self, results: Results, sync: bool = True) -> Recorded:
        """Store new results, then mark their input slots DEAD (durable at the next flush).

        With `sync=False` the caller batches several calls and then calls
        `sync_outputs()`, which makes the outputs durable before it writes any
        of their tombstones (group commit; invariant 3 still holds).
        """
        job = self.load_job(results.job_id)
        n = len(results.slot)
        index = (results.seq & np.uint64(0xFFFFFFFF)).astype(np.int64)
        keep = np.ones(n, dtype=bool)
        retire = np.zeros(n, dtype=bool)
        shape = np.zeros(n, dtype=np.uint32)
        refused: list[str] = []
        duplicates = 0
        for segment_id in np.unique(results.segment).tolist():
            mine = results.segment == segment_id
            where = np.flatnonzero(mine)
            try:
                seg = self.open_input(int(segment_id))
            except (FabricError, OSError) as exc:
                refused.append(f"segment {segment_id}: {exc}")
                keep[where] = False
                continue
            slots = results.slot[mine].astype(np.int64)
            inside = slots < seg.capacity
            states = np.full(len(slots), EMPTY, np.uint32)
            states[inside] = seg.markers[slots[inside]] & STATE_MASK
            wrong_seq = np.ones(len(slots), bool)
            wrong_seq[inside] = seg.slots["seq"][slots[inside]] != results.seq[mine][inside]
            if inside.any():  # read once; not kept resident in this process
                seg.release_slots(int(slots[inside].min()), int(slots[inside].max()))
            bad = (states == EMPTY) | wrong_seq
            for i in np.flatnonzero(bad).tolist():
                refused.append(
                    f"segment {segment_id} slot {int(slots[i])}: seq {int(results.seq[mine][i])} "
                    f"does not match the slot ({'never written' if states[i] == EMPTY else 'another item'})"
                )
            dead = ~bad & (states == DEAD)
            if dead.any():  # retired already: said again, so whoever sent it again can forget it
                self._pending[int(segment_id)].append(slots[dead])
            keep[where[bad | dead]] = False
            retire[where[~bad & (states == LIVE)]] = True
            model = self.models.id_for({"model": seg.key.name})
            shape[where] = (min(seg.key.shape, 0xFFFF) << 8) | min(model, 0xFF)
            duplicates += int(dead.sum())
        already = keep & job.seen(index)
        duplicates += int(already.sum())
        fresh = np.flatnonzero(keep & ~already)
        _, first = np.unique(
            index[fresh], return_index=True
        )  # one result per item, even in one batch
        fresh = fresh[np.sort(first)]
        status = results.status.astype(np.uint32) & np.uint32(0xFF)
        prompt = (
            results.prompt_tokens if results.prompt_tokens is not None else np.zeros(n, np.uint32)
        )
        self._store(
            job,
            results.job_no,
            results.seq[fresh],
            index[fresh],
            status[fresh] | (shape[fresh] << np.uint32(8)),
            prompt[fresh],
            results.payload,
            results.offsets[fresh],
            np.diff(results.offsets)[fresh],
        )
        for segment_id in np.unique(results.segment[retire]).tolist():
            slots = results.slot[retire & (results.segment == segment_id)].astype(np.int64)
            self._to_retire.append((int(segment_id), slots))
        if sync:
            self.sync_outputs()
        return Recorded(len(fresh), duplicates, refused)

    def record_errors(self, job_id: str, job_no: int, index: np.ndarray, reasons: list[str]) -> int:
        """Error results for items that never reached the input log (rejected lines).

        Stored unless the item already has a result; durable at `sync_outputs()`.
        """
        job = self.load_job(job_id)
        index = index.astype(np.int64)
        fresh = np.flatnonzero(~job.seen(index))
        if not len(fresh):
            return 0
        texts = [reasons[i].encode("utf-8")[: SIZE_CLASSES[-1] - 64] for i in fresh.tolist()]
        payload = np.frombuffer(b"".join(texts), np.uint8)
        sizes = np.array([len(t) for t in texts], np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes)))[:-1]
        seq = (np.uint64(job_no) << np.uint64(32)) | index[fresh].astype(np.uint64)
        flags = np.full(len(fresh), flags_of(ERROR_RESULT, TEXT), np.uint32)
        self._store(
            job,
            job_no,
            seq,
            index[fresh],
            flags,
            np.zeros(len(fresh), np.uint32),
            payload,
            offsets,
            sizes,
        )
        return len(fresh)

    def _store(self, job, job_no, seq, index, flags, prompt, payload, starts, sizes) -> None:
        """Append results (flags already final but for too-large ones) to the job's size classes."""
        if not len(seq):
            return
        stored = sizes + PROMPT_HEADER
        too_big = stored > SIZE_CLASSES[-1]
        if too_big.any():
            note = b"result_too_large: the output exceeds the largest result slot"
            payload = np.concatenate((payload, np.frombuffer(note, np.uint8)))
            starts = starts.copy()
            sizes = sizes.copy()
            starts[too_big] = len(payload) - len(note)
            sizes[too_big] = len(note)
            flags = flags.copy()
            flags[too_big] = (flags[too_big] & np.uint32(0xFFFFFF00)) | flags_of(ERROR_RESULT, TEXT)
            stored = sizes + PROMPT_HEADER
        classes = np.searchsorted(np.array(SIZE_CLASSES), stored)
        for c in np.unique(classes).tolist():
            pick = np.flatnonzero(classes == c)
            width = int(stored[pick].max())
            body = np.zeros((len(pick), width), dtype=np.uint8)
            body[:, :PROMPT_HEADER] = prompt[pick].astype("<u4").view(np.uint8).reshape(-1, 4)
            _gather(body[:, PROMPT_HEADER:], payload, starts[pick], sizes[pick])
            appender = self._appender(job, SIZE_CLASSES[c])
            appender.expect(max(len(pick), self.expected_items(job.job_id) - job.completed))
            appender.append(  # a full disk raises here, with nothing of this class stored
                seq[pick],
                np.full(len(pick), job_no, np.uint64),
                index[pick].astype(np.uint32),
                stored[pick].astype(np.uint32),
                body,
                flags[pick],
            )
            self._dirty.add(appender)
            # Marked per class: if a later class fails, a resend finds these as duplicates.
            job.mark(index[pick], (flags[pick] & np.uint32(STATUS_MASK)) == ERROR_RESULT)
            job.last_result_ns = time.time_ns()
            job.segments_changed = True

    @property
    def unsynced(self) -> bool:
        """True while stored results wait for `sync_outputs()` (nothing may be acknowledged)."""
        return bool(self._dirty or self._to_retire)

    def sync_outputs(self) -> None:
        """Make stored results durable, then write their inputs' DEAD markers (invariant 3).

        A failed sync (DiskFullError) keeps everything queued for the next call.
        """
        for appender in self._dirty:
            appender.sync()  # output durable before any tombstone
        self._dirty.clear()
        for segment_id, slots in self._to_retire:
            self.open_input(segment_id).tombstone(slots)  # markers, then the deleted count
            self._pending[segment_id].append(slots)
        self._to_retire.clear()

    def flush_tombstones(self) -> dict[int, np.ndarray]:
        """Make the DEAD markers written since the last flush durable; returns them by segment."""
        done = {}
        for segment_id, parts in self._pending.items():
            self.open_input(segment_id).sync()
            done[segment_id] = np.concatenate(parts)
        self._pending.clear()
        return done

    # ---- delivery ------------------------------------------------------------------------
    def _readers(self, job: _Job) -> dict[int, Segment]:
        """Open handles on the job's completion segments; the directory is listed again only
        after this process appended results for the job (which may create a segment)."""
        if not job.segments_changed:
            return job.readers
        job.segments_changed = False
        for path in self._paths(job.job_id):
            segment_id = int(path.name[4:16])
            if segment_id not in job.readers:
                try:
                    job.readers[segment_id] = Segment.open(path, writable=True)
                except (FabricError, OSError):
                    job.segments_changed = True  # try it again next time
                    continue
        return job.readers

    def page(
        self,
        job_id: str,
        limit: int,
        cursors: dict[int, int] | None = None,
        everything: bool = False,
    ) -> Page:
        """Up to `limit` undelivered results of the job, oldest first.

        With `everything`, delivered ones too, from `cursors` (completion segment
        id -> first slot not yet read, as returned in `Page.next`).
        """
        job = self.load_job(job_id)
        readers = self._readers(job)
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
            slots = np.flatnonzero(wanted)[: limit - taken] + begin
            if not len(slots):
                continue
            cursors[segment_id] = int(slots[-1]) + 1
            ok = seg.verify(slots)
            if not ok.all():  # never sent; marked delivered so nothing waits on it for ever
                bad = slots[~ok]
                log.error(
                    "job %s: %d stored result(s) in %s fail their checksum and are lost: slots %s",
                    job_id,
                    len(bad),
                    seg.path.name,
                    bad[:10].tolist(),
                )
                live = bad[(seg.markers[bad] & STATE_MASK) == LIVE]
                if len(live):
                    seg.tombstone(live)
                    seg.sync()
                slots = slots[ok]
            where.append((segment_id, slots))
            parts.append((seg, slots))
            taken += len(slots)
        return _page(where, parts, cursors)

    def delivered(self, job_id: str, where: list[tuple[int, np.ndarray]]) -> int:
        """Mark results delivered (DEAD in the completion log) and make that durable."""
        job = self.load_job(job_id)
        readers = self._readers(job)
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

    def undelivered(self, job_id: str) -> int:
        job = self.load_job(job_id)
        return sum(
            int(((seg.markers & STATE_MASK) == LIVE).sum()) for seg in self._readers(job).values()
        )

    def finish_job(self, job_id: str) -> None:
        """Every item has a result: seal its completion segments (the collector may take them
        once delivered and past retention)."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        for appender in job.appenders.values():
            appender.close()
        job.appenders.clear()

    def unload(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        for appender in job.appenders.values():
            appender.close()
        for seg in job.readers.values():
            seg.close()

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.unload(job_id)


def _page(where, parts, next_at) -> Page:
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
    offsets = np.concatenate(([0], np.cumsum(count - PROMPT_HEADER)))
    return Page(
        where,
        index.astype(np.uint32),
        (flags & STATUS_MASK).astype(np.uint8),
        ((flags >> 4) & 0x0F).astype(np.uint8),
        ((flags >> 8) & 0xFF).astype(np.uint8),
        (flags >> 16).astype(np.uint16),
        prompt.astype(np.uint32),
        payload,
        offsets.astype(np.int64),
        next_at,
    )


def subset(payload: np.ndarray, offsets: np.ndarray, pick: np.ndarray) -> tuple:
    """The payload bytes and n + 1 offsets of the items at `pick` (vectorized gather)."""
    starts = offsets[:-1][pick]
    sizes = np.diff(offsets)[pick]
    new_offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    if not len(pick) or not sizes.sum():
        return np.zeros(0, np.uint8), new_offsets
    index = np.repeat(starts - new_offsets[:-1], sizes) + np.arange(int(sizes.sum()))
    return payload[index], new_offsets


def _gather(out: np.ndarray, payload: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
    """Copy item i's bytes payload[starts[i] : starts[i] + sizes[i]] to the front of out[i]."""
    n = len(sizes)
    if not n:
        return
    size = int(sizes[0])
    if (sizes == size).all():
        first = int(starts[0])
        if (starts == first + np.arange(n) * size).all():  # back to back: one reshape, one copy
            out[:, :size] = payload[first : first + n * size].reshape(n, size)
        else:
            out[:, :size] = payload[starts[:, None] + np.arange(size)[None, :]]
        return
    columns = np.arange(out.shape[1])[None, :]
    mask = columns < sizes[:, None]
    out[mask] = payload[(starts[:, None] + columns)[mask]]
