"""The completion stage's durable path: output, then tombstone, then count (invariant 3).

`CompletionLog.record()` takes a batch of results from a worker and, for
each item, first checks the input slot it answers: a slot already DEAD, or
an item that already has a result in the completion log, is a duplicate
(computation can repeat, observable completion happens once: invariant 5);
a seq that does not match the slot's is refused (a stale or forged result).
The new results are appended to the job's completion segments (the same
segment format, kind 2, keyed by job and size class; the slot layout is in
collector/completion/record_format.py) and synced: one fdatasync per touched
segment. Only then are the input markers written DEAD; `flush_tombstones()`
makes them durable about every 100 ms (one fdatasync per touched input
segment) and returns what retired, which is when dispatch may forget the
items and the worker may be acknowledged. Duplicates of items that already
have a result are retired too, so a crash between output and tombstone
heals, and a duplicate whose slot is DEAD already is returned by the next
flush again (dispatch, which sends item errors again until it sees them
retired, learns that a copy it resent after a completion restart is done).

Per job, the exact counters (collector/completion/job_results.py) are
rebuilt from the completion log itself (`load_job`), never from a persisted
count, so progress never doubles after a restart.

Delivery reads results back (`page`) and marks them delivered (`delivered`),
through collector/completion/pages.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collector.completion.job_results import JobResults
from collector.completion.line_pages import ready_rows, whole_lines
from collector.completion.pages import (
    Page,
    mark_delivered,
    open_readers,
    read_page,
)
from collector.completion.record_format import (
    FIRST_SEGMENT_BYTES,
    MODELS_FILE,
    PROMPT_HEADER,
    SIZE_CLASSES,
    TOO_LARGE,
    first_words,
    flags_of,
    result_tokens,
    status_of,
)
from pipeline.core.errors import FabricError
from pipeline.core.item_seq import index_of, seq_of
from pipeline.core.line_table import LineTable
from pipeline.core.ragged import offsets_of, pad
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.datadir import DataDir
from pipeline.store.intern_table import InternTable
from pipeline.store.segment import Segment
from pipeline.store.segment_append import SegmentAppender, SegmentIds
from pipeline.store.segment_format import (
    DEAD,
    EMPTY,
    KIND_COMPLETION,
    LIVE,
    STATE_MASK,
    SUFFIX,
    SegmentKey,
    slot_bytes_for,
)


@dataclass(eq=False)
class Results:
    """One worker batch of results, all for one job."""

    job_id: str
    job_no: int
    segment: np.ndarray  # u8 per item: the input segment
    slot: np.ndarray  # u4
    seq: np.ndarray  # u8
    status: np.ndarray  # u4: ResultStatus, optionally | kind << 4
    payload: np.ndarray  # u1, every item's bytes back to back
    offsets: np.ndarray  # i8, n + 1
    prompt_tokens: np.ndarray | None = None  # u4 per item


@dataclass(eq=False)
class Recorded:
    stored: int  # new results made durable
    duplicates: int  # already DEAD, or already had a result
    refused: list[str]  # one line per refused item (seq mismatch, never written)


class CompletionLog:
    """Owned by the completion stage; `open_input(segment_id)` gives a writable input segment."""

    def __init__(
        self,
        data_dir: DataDir,
        open_input: Callable[[int], Segment],
        segment_bytes: int = 64 << 20,
        expected_items: Callable[[str], int] = lambda job_id: 0,
        line_table: Callable[[str], LineTable | None] = lambda job_id: None,
    ) -> None:
        self.data_dir = data_dir
        self.models = InternTable(data_dir.root, MODELS_FILE)
        self.open_input = open_input
        self.segment_bytes = segment_bytes
        self.expected_items = expected_items  # job id -> items known so far (a sizing hint)
        self.line_table = line_table  # job id -> its fan-out lines (None: none known)
        self.ids = SegmentIds(data_dir)
        self._jobs: dict[str, JobResults] = {}
        self._pending: dict[int, list[np.ndarray]] = defaultdict(
            list
        )  # input segment -> slots marked DEAD, not yet synced
        self._to_retire: list[tuple[int, np.ndarray]] = []  # written, output not yet synced
        self._dirty: set[SegmentAppender] = set()

    def _paths(self, job_id: str) -> list[Path]:
        return sorted(self.data_dir.completion.glob(f"out-*.{job_id}.s0.l*{SUFFIX}"))

    def load_job(self, job_id: str) -> JobResults:
        """The job's state, rebuilt from its completion segments on first use."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        job = JobResults(job_id)
        for path in self._paths(job_id):
            with Segment.open(path) as seg:
                if seg.key.name != job_id:
                    continue
                states = seg.states()
                job.undelivered += int((states == LIVE).sum())
                written = np.flatnonzero(states != EMPTY)
                good = written[seg.verify(written)]
                flags = seg.slots["flags"][good]
                index = seg.slots["index"][good].astype(np.int64)
                fresh = ~job.seen(index)
                _, first = np.unique(index, return_index=True)
                once = np.zeros(len(good), bool)
                once[first] = True
                once &= fresh  # each item's tokens once, whatever the log holds
                heads = np.ascontiguousarray(seg.bodies[good[once], : PROMPT_HEADER + 4])
                heads = heads.view("<u4").reshape(-1, 2)  # [prompt tokens, first payload word]
                job.add_tokens(
                    *result_tokens(
                        flags[once],
                        heads[:, 0],
                        seg.slots["count"][good[once]].astype(np.int64) - PROMPT_HEADER,
                        heads[:, 1],
                    ),
                    index[once],
                )
                job.mark(index, status_of(flags) == ResultStatus.ERROR)
        self._jobs[job_id] = job
        return job

    def known_jobs(self) -> list[str]:
        return list(self._jobs)

    def tokens(self, job_id: str) -> tuple[int, int]:
        """(prompt tokens, generated tokens) over the job's results, each result once and each
        prompt once (the samples j > 0 of a prompt add no prompt tokens)."""
        job = self.load_job(job_id)
        return job.prompt_total(self.line_table(job_id)), job.completion_tokens

    def completed(self, job_id: str) -> int:
        """Lines of the job done: every part with a result or an error result."""
        return self.load_job(job_id).line_counts(self.line_table(job_id))[0]

    def failed(self, job_id: str) -> int:
        """Lines of the job done with an error result in some part."""
        return self.load_job(job_id).line_counts(self.line_table(job_id))[1]

    def _appender(self, job: JobResults, size_class: int) -> SegmentAppender:
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
        index = index_of(results.seq)
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
                what = "never written" if states[i] == EMPTY else "another item"
                refused.append(
                    f"segment {segment_id} slot {int(slots[i])}: seq {int(results.seq[mine][i])} "
                    f"does not match the slot ({what})"
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
        texts = [r.encode("utf-8")[: SIZE_CLASSES[-1] - 64] for r in reasons]
        flags = np.full(len(texts), flags_of(ResultStatus.ERROR, ResultKind.TEXT), np.uint32)
        return self.record_direct(job_id, job_no, index, flags, np.zeros(len(texts)), texts)

    def record_direct(
        self, job_id: str, job_no: int, index: np.ndarray, flags, prompt, bodies: list[bytes]
    ) -> int:
        """Results for items that never reached the input log (rejected lines, and lines the
        reuse index answered: collector/completion/reuse.py), each `flags`, `prompt` tokens and
        body. Stored unless the item already has a result; durable at `sync_outputs()`."""
        job = self.load_job(job_id)
        index = index.astype(np.int64)
        fresh = np.flatnonzero(~job.seen(index))
        if not len(fresh):
            return 0
        texts = [bodies[i] for i in fresh.tolist()]
        payload = np.frombuffer(b"".join(texts), np.uint8)
        sizes = np.array([len(t) for t in texts], np.int64)
        starts = offsets_of(sizes)[:-1]
        seq = seq_of(job_no, index[fresh])
        self._store(
            job,
            job_no,
            seq,
            index[fresh],
            np.asarray(flags, np.uint32)[fresh],
            np.asarray(prompt, np.uint32)[fresh],
            payload,
            starts,
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
            payload = np.concatenate((payload, np.frombuffer(TOO_LARGE, np.uint8)))
            starts = starts.copy()
            sizes = sizes.copy()
            starts[too_big] = len(payload) - len(TOO_LARGE)
            sizes[too_big] = len(TOO_LARGE)
            flags = flags.copy()
            error = flags_of(ResultStatus.ERROR, ResultKind.TEXT)
            flags[too_big] = (flags[too_big] & np.uint32(0xFFFFFF00)) | error
            stored = sizes + PROMPT_HEADER
        classes = np.searchsorted(np.array(SIZE_CLASSES), stored)
        for c in np.unique(classes).tolist():
            pick = np.flatnonzero(classes == c)
            width = int(stored[pick].max())
            body = np.zeros((len(pick), width), dtype=np.uint8)
            body[:, :PROMPT_HEADER] = prompt[pick].astype("<u4").view(np.uint8).reshape(-1, 4)
            body[:, PROMPT_HEADER:] = pad(payload, starts[pick], sizes[pick], width - PROMPT_HEADER)
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
            job.undelivered += len(pick)
            # Marked per class: if a later class fails, a resend finds these as duplicates.
            job.mark(index[pick], status_of(flags[pick]) == ResultStatus.ERROR)
            first = first_words(payload, starts[pick], sizes[pick])
            job.add_tokens(
                *result_tokens(flags[pick], prompt[pick], sizes[pick], first), index[pick]
            )
            job.segments_changed = True

    @property
    def unsynced(self) -> bool:
        """True while stored results wait for `sync_outputs()` (nothing may be acknowledged)."""
        return bool(self._dirty or self._to_retire)

    @property
    def tombstones_pending(self) -> bool:
        """True while DEAD markers wait for `flush_tombstones()`."""
        return bool(self._pending)

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

    # ---- delivery (collector/completion/pages.py) -----------------------------------------
    def _readers(self, job: JobResults) -> dict[int, Segment]:
        return open_readers(job, self._paths(job.job_id) if job.segments_changed else [])

    def page(
        self,
        job_id: str,
        limit: int,
        cursors: dict[int, int] | None = None,
        everything: bool = False,
        known: Callable[[np.ndarray], np.ndarray] | None = None,
        skip: dict[int, np.ndarray] | None = None,
    ) -> Page:
        """Up to `limit` undelivered results of the job, oldest first; `known` (per item
        index) leaves out those whose line is not committed yet (collector/job_view.py);
        `skip` (completion segment id -> slots) those of pages sent and not acknowledged yet.

        With `everything`, delivered ones too, from `cursors` (completion segment
        id -> first slot not yet read, as returned in `Page.next`).
        """
        job = self.load_job(job_id)
        readers = self._readers(job)
        table = self.line_table(job_id)
        fanned = table is not None and len(table) > 0
        ready = ready_rows(job, table) if fanned and not everything else None
        if known is not None and not everything:
            ready = known if ready is None else _both(ready, known)
        page = read_page(job, readers, limit, cursors, everything, ready, skip)
        if not fanned or not len(page):
            return page
        return whole_lines(page, job, readers, table, everything, limit)

    def delivered(self, job_id: str, where: list[tuple[int, np.ndarray]]) -> int:
        """Mark results delivered (DEAD in the completion log) and make that durable."""
        job = self.load_job(job_id)
        count = mark_delivered(self._readers(job), where)
        job.undelivered -= count
        return count

    def undelivered(self, job_id: str) -> int:
        """Results of the job not delivered yet (kept by JobResults: nothing is opened)."""
        return self.load_job(job_id).undelivered

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


def _both(first, second):
    """Two of read_page's filters: an item goes when both let it."""
    return lambda index: first(index) & second(index)
