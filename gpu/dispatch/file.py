"""Dispatch files: the dispatch stage's record of which items are out on lease (invariant 11).

If the dispatch process dies and the supervisor restarts it inside the same
broker life, it reloads this file so it does not send again what is already
out with a worker. A new broker life (another epoch) discards the file. The
file is a cache: losing its tail costs a duplicate dispatch, never an item,
so a disk error is logged and retried, never raised to the owner. The layout
and how it is read back: gpu/dispatch/file_format.py.

Writing is a group commit: `lease()` and `drop()` encode into an in-memory
buffer; `maybe_sync()` hands the buffer to one writer thread (write +
fdatasync) and returns at once; `sync()` waits for it. `compact()` replaces
the whole file (tmp + fsync + rename + directory fsync) with the live leases
only, superseding every entry not yet written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from gpu.dispatch.file_format import (
    ENTRY,
    HEADER_BYTES,
    LEASE_DTYPE,
    LEASE_HEAD,
    SLOT_DTYPE,
    DispatchFileError,
    Lease,
    encode_drop,
    encode_header,
    encode_lease,
    parse_header,
    read_leases,
)
from pipeline.store.durable import fsync_dir

log = logging.getLogger("fabric.dispatch")

STILL_FAILING_LOG_S = 60.0


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class DispatchFile:
    """The owner's handle: one owner thread calls every method; one writer thread does the I/O.

    Made by `open()`. Memory: the entries not yet written, and per batch
    still out two counters for `garbage_ratio`; nothing per item.
    """

    def __init__(
        self, path: Path, epoch: int, sync_entries: int, sync_ms: float, fd: int, end: int
    ) -> None:
        self.path = path
        self.epoch = epoch
        self.sync_entries = sync_entries
        self.sync_s = sync_ms / 1000.0
        # Owner-only.
        self._buffer: list[bytes] = []
        self._pending_since: float | None = None
        self._batches: dict[int, list[int]] = {}  # batch_id -> [items left, entry overhead]
        self._file_bytes = end
        self._live_bytes = 0
        # Shared with the writer thread, under _cond.
        self._cond = threading.Condition()
        self._queued: list[bytes] = []
        self._queued_file: bytes | None = None  # a whole new file to write first
        self._asked = 0  # generation of the last hand-over
        self._done = 0  # generation the writer has finished (well or not)
        self._failing = False
        self._stopping = False
        # Writer-only (the owner sets them before the thread starts).
        self._fd = fd
        self._end = end
        self._failed_at: float | None = None
        self._tries = 0
        self._writer = threading.Thread(
            target=self._run, name=f"dispatch-file {path.name}", daemon=True
        )

    @classmethod
    def open(
        cls, path: Path, epoch: int, *, sync_entries: int = 32, sync_ms: float = 100.0
    ) -> tuple[DispatchFile, list[Lease]]:
        """Open or create `path` for broker life `epoch`; return it and the leases still live.

        A file of another epoch, or one that is missing or has a damaged
        header, is replaced by a fresh one (nothing reloaded). A torn or
        corrupt entry ends the reading; it and everything after it is cut
        before the first append. A disk error is logged and the fresh file
        is written later by the writer thread.
        """
        path = Path(path)
        if not 0 <= epoch < 1 << 64:
            raise DispatchFileError(f"{path}: epoch {epoch!r} is not an unsigned 64-bit int")
        if sync_entries < 1 or sync_ms < 0:
            raise DispatchFileError(
                f"{path}: sync_entries {sync_entries} must be >= 1 and sync_ms {sync_ms} >= 0"
            )
        with contextlib.suppress(OSError):  # a compaction that died before its rename
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            log.error("%s: cannot read the dispatch file (%s); starting a fresh one", path, exc)
            data = b""
        header = parse_header(data)
        leases: list[Lease] = []
        fd, end = -1, HEADER_BYTES
        if header is not None and header[0] == epoch:
            leases, end = read_leases(data)
            try:
                fd = os.open(path, os.O_RDWR)
                if end != len(data):
                    log.warning(
                        "%s: cut %d bytes of torn or corrupt entries at offset %d",
                        path,
                        len(data) - end,
                        end,
                    )
                    os.ftruncate(fd, end)
            except OSError as exc:
                log.error("%s: cannot open the dispatch file (%s); starting a fresh one", path, exc)
                if fd >= 0:
                    os.close(fd)
                fd, leases, end = -1, [], HEADER_BYTES
        elif data:
            found = "a damaged header" if header is None else f"epoch {header[0]}"
            log.info("%s: has %s, not epoch %d; starting a fresh file", path, found, epoch)
        self = cls(path, epoch, sync_entries, sync_ms, fd, end)
        for lease in leases:
            self._count_lease(lease.batch_id, lease.session, len(lease.items))
        if fd < 0:  # a fresh file; on a disk error the writer thread tries again
            self._queued_file, _ = self._write_queued(b"", [])
            self._failing = self._queued_file is not None
        self._writer.start()
        return self, leases

    # -- recording (owner thread, no I/O) ------------------------------------

    def lease(self, batch_id: int, session: str, items: np.ndarray) -> None:
        """Record that `items` (one segment's) went out as batch `batch_id` to worker `session`."""
        entry = encode_lease(batch_id, session, items)
        if len(items) and np.any(items["segment"] != items["segment"][0]):
            raise DispatchFileError(
                f"batch {batch_id}: items span segments "
                f"{np.unique(items['segment']).tolist()[:4]}; a batch is one segment"
            )
        self._add(entry)
        self._count_lease(batch_id, session, len(items))

    def drop(self, batch_id: int, slots_of_segment: np.ndarray | None = None) -> None:
        """Record that these slots of batch `batch_id` left the lease; None: all of it (END).

        An empty array records nothing.
        """
        if slots_of_segment is None:
            self._add(encode_drop(batch_id, None))
            counted = self._batches.pop(batch_id, None)
            if counted is not None:
                self._live_bytes -= counted[1] + counted[0] * LEASE_DTYPE.itemsize
            return
        slots = np.asarray(slots_of_segment)
        if slots.ndim != 1 or (len(slots) and slots.dtype.kind not in "ui"):
            raise DispatchFileError(
                f"batch {batch_id}: slots must be a 1-D integer array, got {slots.dtype} "
                f"with shape {slots.shape}"
            )
        if not len(slots):
            return
        self._add(encode_drop(batch_id, slots.astype(SLOT_DTYPE, copy=False)))
        counted = self._batches.get(batch_id)
        if counted is not None:
            gone = min(len(slots), counted[0])
            counted[0] -= gone
            self._live_bytes -= gone * LEASE_DTYPE.itemsize

    def _add(self, entry: bytes) -> None:
        self._buffer.append(entry)
        self._file_bytes += len(entry)

    def _count_lease(self, batch_id: int, session: str, n: int) -> None:
        overhead = ENTRY.size + LEASE_HEAD.size + len(session)
        counted = self._batches.setdefault(batch_id, [0, 0])
        counted[0] += n
        counted[1] += overhead
        self._live_bytes += overhead + n * LEASE_DTYPE.itemsize

    # -- durability ----------------------------------------------------------

    @property
    def pending_entries(self) -> int:
        """Entries recorded but not yet handed to the writer thread."""
        return len(self._buffer)

    @property
    def failing(self) -> bool:
        """True while the last write failed (its entries wait, in order, for the next try)."""
        return self._failing

    @property
    def file_bytes(self) -> int:
        """The file's size once everything recorded so far is written."""
        return self._file_bytes

    @property
    def garbage_ratio(self) -> float:
        """Estimated share of the entry bytes that compaction would remove (0 to 1).

        Counts DROP entries and the items and headers of resolved batches;
        a slot leased again without a DROP of its old batch is not counted.
        """
        entries = self._file_bytes - HEADER_BYTES
        if entries <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self._live_bytes / entries))

    def maybe_sync(self, now: float) -> bool:
        """Hand the buffer to the writer when `sync_entries` are pending or `sync_ms` has passed.

        The age counts from the first call of this method that saw the
        entry (or a failed write still waiting), on the owner's clock `now`.
        Returns at once, whether or not it handed anything over.
        """
        if not self._buffer and not self._failing:
            self._pending_since = None
            return False
        if self._pending_since is None:
            self._pending_since = now
        due = len(self._buffer) >= self.sync_entries or now >= self._pending_since + self.sync_s
        if due:
            self._hand_over()
        return due

    def sync(self, timeout_s: float | None = None) -> bool:
        """Make everything recorded so far durable; block until the writer is done.

        Returns True when it is all on disk, False when the write failed
        (logged; kept for the next try) or `timeout_s` passed.
        """
        if not self._writer.is_alive():
            return False  # closed
        ask = self._hand_over()
        with self._cond:
            done = self._cond.wait_for(lambda: self._done >= ask, timeout_s)
            return done and not self._failing and not self._queued and self._queued_file is None

    def compact(self, live: list[Lease]) -> None:
        """Replace the file by one holding only `live` (same epoch); returns without waiting.

        `live` must be the owner's whole truth: every entry recorded and not
        yet written is superseded and dropped. Call `sync()` to wait for it.
        """
        body = b"".join(encode_lease(lease.batch_id, lease.session, lease.items) for lease in live)
        self._buffer.clear()
        self._batches.clear()
        self._live_bytes = 0
        for lease in live:
            self._count_lease(lease.batch_id, lease.session, len(lease.items))
        self._file_bytes = HEADER_BYTES + len(body)
        self._pending_since = None
        with self._cond:
            self._queued_file = body
            self._queued.clear()
            self._asked += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Sync, stop the writer thread and close the file. Idempotent."""
        if not self._writer.is_alive() and self._fd < 0:
            return
        if not self.sync():
            log.error("%s: closing with dispatch entries that never reached the disk", self.path)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._writer.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DispatchFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _hand_over(self) -> int:
        with self._cond:
            self._queued.extend(self._buffer)
            self._asked += 1
            self._cond.notify_all()
            ask = self._asked
        self._buffer = []
        self._pending_since = None
        return ask

    # -- the writer thread ---------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._asked > self._done)
                if self._asked <= self._done:
                    return
                ask, whole, chunks = self._asked, self._queued_file, self._queued
                self._queued_file, self._queued = None, []
            whole_left, chunks_left = self._write_queued(whole, chunks)
            with self._cond:
                if self._queued_file is None:  # else a newer compaction supersedes what failed
                    self._queued_file = whole_left
                    self._queued[:0] = chunks_left
                self._failing = whole_left is not None or bool(chunks_left)
                self._done = ask
                self._cond.notify_all()

    def _write_queued(self, whole: bytes | None, chunks: list[bytes]):
        """Write a new file (if any), then append; return what is still to write."""
        try:
            if whole is not None:
                self._replace(whole)
                whole = None
            if chunks:
                data = b"".join(chunks)
                try:
                    _write_all(self._fd, data, self._end)
                    os.fdatasync(self._fd)
                except OSError:
                    # A partial write must not sit before the next try's entries; if
                    # the cut fails too, the next try writes over it at the same offset.
                    with contextlib.suppress(OSError):
                        os.ftruncate(self._fd, self._end)
                    raise
                self._end += len(data)
                chunks = []
        except Exception as exc:
            self._tries += 1
            now = time.monotonic()
            if self._failed_at is None or now - self._failed_at >= STILL_FAILING_LOG_S:
                self._failed_at = now
                log.error(
                    "%s: cannot write the dispatch file (%s); %d entries kept in memory, "
                    "retrying (try %d); free space under %s",
                    self.path,
                    exc,
                    len(chunks),
                    self._tries,
                    self.path.parent,
                )
            return whole, chunks
        if self._tries:
            log.info("%s: dispatch file writes again after %d tries", self.path, self._tries)
            self._tries, self._failed_at = 0, None
        return None, []

    def _replace(self, body: bytes) -> None:
        """Write header + body to a temporary file, sync it and rename it over the file."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                _write_all(fd, encode_header(self.epoch, time.time_ns()) + body, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._end = fd, HEADER_BYTES + len(body)
