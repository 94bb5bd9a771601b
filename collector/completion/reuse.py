"""Completion's side of result reuse: found lines stored, new results indexed, old ones evicted.

The front decides which lines of a `--reuse` job the index answers
(ingest/reuse_keys.py) and names them in the chunk's commit record; this stage,
the index's one writer (pipeline/store/reuse_store.py), then:

* stores each found line's result (`store_found`, beside the rejected lines: the
  same durable path, from the same journal, so a crash before it stores them
  stores them at the next start, and a line never gets two results) with the
  line's own model and shape in its flags and the usage first measured; a record
  gone or damaged since the front found it becomes the line's error
  `reuse_lost` (it is never a wrong result);
* appends the results workers return for a reusing job's deterministic lines
  (`note`, keyed by the commit record's `rk`) and indexes them at `flush`, at
  most every `FLUSH_S` (one fdatasync of the data file, then the table);
* evicts by retention and size every `EVICT_S` (`evict`).
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import numpy as np

from collector.completion.record_format import flags_of
from collector.completion.results_log import CompletionLog
from collector.job_view import JobView
from ingest.reuse_keys import keys_of_hex
from pipeline.core.errors import DiskFullError
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.core.ragged import Ragged
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.reuse_store import ReuseWriter, read_results, reuse_dir

FLUSH_S = 1.0
MAX_WAITING = 1 << 20  # results waiting for their commit record; beyond, not indexed
EVICT_S = 60.0
LOST = (
    f"{ItemErrorCode.REUSE_LOST}: the stored result of an identical earlier request was "
    "evicted or damaged before this line took it; submit the line again"
)
LOST_BYTES = LOST.encode()


class ResultReuse:
    """The completion stage's part of result reuse (one thread)."""

    def __init__(
        self,
        data_root: Path,
        completion_log: CompletionLog,
        retention_s: float,
        max_bytes: int,
        log: logging.Logger,
    ) -> None:
        self.data_root = Path(data_root)
        self.completion_log = completion_log
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.log = log
        self.writer: ReuseWriter | None = None  # opened with the first result to index
        self.reused: collections.Counter[str] = collections.Counter()  # model -> lines stored
        self.lost = 0  # found lines whose record was gone (metrics)
        self.next_flush = 0.0
        self.next_evict = 0.0
        self.unavailable = False  # the index could not be opened for writing in this life
        # results whose chunk's commit record was not read yet: (view, index, flags, rows, prompt)
        self.waiting: list[tuple] = []
        self.waiting_items = 0

    def _writer(self) -> ReuseWriter | None:
        if self.writer is None and not self.unavailable:
            try:
                self.writer = ReuseWriter(self.data_root, self.retention_s, self.max_bytes)
            except OSError as exc:  # another broker indexes into a shared one, or a full disk
                self.unavailable = True
                self.log.warning(
                    "reuse index %s not opened for writing (%s): this broker reuses what it "
                    "holds but adds nothing to it until it restarts",
                    reuse_dir(self.data_root),
                    exc,
                )
        return self.writer

    def store_found(self, view: JobView) -> None:
        """Store the results of the job's lines the front found in the index, durable before
        this returns. DiskFullError: those not stored stay in the view for the next call."""
        found, view.found = view.found, []
        if not found:
            return
        try:
            keys = keys_of_hex(r[1] for r in found)
            where = np.array([r[4:7] for r in found], np.uint64).reshape(-1, 3)
            results = read_results(self.data_root, keys, where)
            for model in sorted({r[2] for r in found}):
                pick = [i for i, r in enumerate(found) if r[2] == model]
                self._store(view, model, [found[i] for i in pick], [results[i] for i in pick])
            self.completion_log.sync_outputs()
        except DiskFullError:
            view.found[:0] = found
            raise

    def _store(self, view: JobView, model: str, found, results) -> None:
        model_id = self.completion_log.models.id_for({"model": model})
        index = np.array([int(r[0]) - 1 for r in found], np.int64)
        ok = np.array([r is not None for r in results], bool)
        kept = [r for r in results if r is not None]
        status = np.full(len(found), ResultStatus.ERROR, np.uint32)
        kind = np.full(len(found), ResultKind.TEXT, np.uint32)
        status[ok] = [r.status for r in kept]
        kind[ok] = [r.kind for r in kept]
        shape = np.where(ok, np.array([int(r[3]) for r in found], np.uint32), 0)
        flags = flags_of(status, kind, np.where(ok, model_id, 0), shape)
        prompt = np.zeros(len(found), np.uint32)
        prompt[ok] = [r.prompt_tokens for r in kept]
        bodies = [LOST_BYTES if r is None else r.payload for r in results]
        stored = self.completion_log.record_direct(
            view.job_id, view.job_no, index, flags, prompt, bodies
        )
        self.reused[model] += stored
        lost = int((~ok).sum())
        if lost:
            self.lost += lost
            self.log.warning(
                "job %s: %d reused line(s) lost their stored result", view.job_id, lost
            )

    def note(
        self, view: JobView, index: np.ndarray, flags: np.ndarray, rows: Ragged, prompt
    ) -> None:
        """A reusing job's results as stored: those with a request key go into the index. A
        result can come before completion read its chunk's commit record (or before the front
        wrote it): those wait, and are tried again at each flush."""
        if not view.reuse or not len(index):
            return
        known = view.known(index)
        if not known.all():
            view.refresh()
            known = view.known(index)
        if not known.all():
            late = np.flatnonzero(~known)
            if self.waiting_items < MAX_WAITING:
                self.waiting.append(
                    (view, index[late], flags[late], rows.take(late), np.asarray(prompt)[late])
                )
                self.waiting_items += len(late)
            index, flags, prompt = index[known], flags[known], np.asarray(prompt)[known]
            rows = rows.take(np.flatnonzero(known))
        keys = view.request_keys(index)
        status = flags & np.uint32(0xF)
        ok = np.flatnonzero(keys.any(axis=1) & (status == ResultStatus.RESULT))
        if not len(ok):
            return
        kept = rows.take(ok) if len(ok) < len(index) else rows
        writer = self._writer()
        if writer is None:
            return
        try:
            writer.append(
                keys[ok],
                ((flags[ok] >> 4) & 0xF).astype(np.uint8),
                status[ok].astype(np.uint8),
                np.asarray(prompt, np.uint32)[ok],
                kept,
            )
        except OSError as exc:  # a full disk: these are not indexed (they run again next time)
            self.log.warning("reuse index: %d result(s) not indexed: %s", len(ok), exc)

    def flush(self, now: float, force: bool = False) -> None:
        """Index what was appended (at most every FLUSH_S unless `force`); evict every EVICT_S."""
        if self.waiting and (force or now >= self.next_flush):
            waiting, self.waiting, self.waiting_items = self.waiting, [], 0
            for view, index, flags, rows, prompt in waiting:
                self.note(view, index, flags, rows, prompt)
        if self.writer is not None and self.writer.pending and (force or now >= self.next_flush):
            self.next_flush = now + FLUSH_S
            try:
                self.writer.flush()
            except OSError as exc:
                self.log.warning("reuse index: results not indexed: %s", exc)
                self.writer.pending = []
        if now >= self.next_evict and reuse_dir(self.data_root).exists():
            self.next_evict = now + EVICT_S
            writer = self._writer()
            if writer is None:
                return
            try:
                dropped = writer.evict()
            except OSError as exc:
                self.log.warning("reuse index: eviction failed (tried again later): %s", exc)
                return
            if dropped:
                self.log.info("reuse index: evicted data file(s) %s", dropped)

    def figures(self) -> dict:
        writer = self.writer
        return {
            "reused": dict(self.reused),
            "reuse_lost": self.lost,
            "reuse_entries": writer.entries if writer is not None else 0,
        }

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
