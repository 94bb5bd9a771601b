"""Dispatch files: the dispatch stage's record of which items are out on lease (invariant 11).

If the dispatch process dies and the supervisor restarts it inside the same
broker life, it reloads this file so it does not send again what is already
out with a worker. A new broker life (another epoch) discards the file. The
file is a cache: losing its tail costs a duplicate dispatch, never an item,
so a disk error is logged and retried, never raised to the owner.

Layout, little-endian, append-only after the header:

| offset | size | field      | meaning                                              |
|--------|------|------------|------------------------------------------------------|
| 0      | 8    | magic      | b"IFDISP1\\0"                                         |
| 8      | 4    | version    | format version, 1                                    |
| 12     | 4    | header     | header size in bytes, 40                             |
| 16     | 8    | epoch      | broker life that wrote the file                      |
| 24     | 8    | created_ns | wall-clock time this file was written (new, compacted) |
| 32     | 4    | header_crc | CRC-32 of bytes 0..32                                |
| 36     | 4    | reserved   | 0                                                    |
| 40     | ...  | entries    | one after another, to the end of the file            |

Entry: `[u32 length][u32 crc][u8 kind][payload]`; `length` counts kind and
payload, `crc` is the CRC-32 of kind and payload.

| kind      | payload                                                                      |
|-----------|------------------------------------------------------------------------------|
| 1 LEASE   | batch_id u64, n u32, session_len u8, session (ASCII), n x item (20 bytes: segment u64, slot u32, seq u64) |
| 2 DROP    | batch_id u64, n u32, n x slot u32; n = 0 is END: the whole batch is resolved |

Reading replays entries in file order and stops at the first one that is
short, fails its CRC, or whose sizes disagree: a torn tail, cut before the
next append. An item is live when no later LEASE names its (segment, slot)
(a slot leased twice belongs to the later batch only), and no later DROP of
its batch names its slot, and no later END names its batch. A LEASE of a
batch id already seen adds to that batch.

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
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.durable import fsync_dir
from pipeline.errors import FabricError

log = logging.getLogger("fabric.dispatch")

LEASE_DTYPE = np.dtype([("segment", "<u8"), ("slot", "<u4"), ("seq", "<u8")])
SLOT_DTYPE = np.dtype("<u4")
MAGIC = b"IFDISP1\0"
VERSION = 1
HEADER_BYTES = 40
KIND_LEASE = 1
KIND_DROP = 2
MAX_SESSION_CHARS = 64
MAX_ENTRY_BYTES = 1 << 30
STILL_FAILING_LOG_S = 60.0

_HEADER = struct.Struct("<8sIIQQ")  # the fields covered by header_crc
_ENTRY = struct.Struct("<II")  # length, crc
_LEASE = struct.Struct("<BQIB")  # kind, batch_id, n, session_len
_DROP = struct.Struct("<BQI")  # kind, batch_id, n


class DispatchFileError(FabricError):
    """A lease or drop cannot be recorded as asked (a bad session id, batch id or item array)."""


@dataclass(eq=False)
class Lease:
    """One batch still out: the items of `batch_id` held by worker `session`."""

    batch_id: int
    session: str
    items: np.ndarray  # LEASE_DTYPE, one segment


def encode_header(epoch: int, created_ns: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, epoch, created_ns)
    return head + struct.pack("<II", zlib.crc32(head), 0)


def parse_header(data: bytes) -> tuple[int, int] | None:
    """(epoch, created_ns), or None when the header is short, foreign or damaged."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, size, epoch, created_ns = _HEADER.unpack_from(data)
    (crc,) = struct.unpack_from("<I", data, _HEADER.size)
    if magic != MAGIC or version != VERSION or size != HEADER_BYTES:
        return None
    if zlib.crc32(data[: _HEADER.size]) != crc:
        return None
    return epoch, created_ns


def _entry(head: bytes, tail: bytes) -> bytes:
    crc = zlib.crc32(tail, zlib.crc32(head))
    return b"".join((_ENTRY.pack(len(head) + len(tail), crc), head, tail))


def encode_lease(batch_id: int, session: str, items: np.ndarray) -> bytes:
    """One LEASE entry; refuses a session id that is not ASCII or longer than 64 characters."""
    if items.dtype != LEASE_DTYPE or items.ndim != 1:
        raise DispatchFileError(
            f"batch {batch_id}: items must be a 1-D LEASE_DTYPE array, got {items.dtype} "
            f"with shape {items.shape}"
        )
    try:
        name = session.encode("ascii")
    except UnicodeEncodeError:
        raise DispatchFileError(
            f"batch {batch_id}: worker session id {session!r} is not ASCII; "
            "session ids must be ASCII"
        ) from None
    if len(name) > MAX_SESSION_CHARS:
        raise DispatchFileError(
            f"batch {batch_id}: worker session id {session!r} has {len(name)} characters, "
            f"more than {MAX_SESSION_CHARS}; use a shorter session id"
        )
    try:
        head = _LEASE.pack(KIND_LEASE, batch_id, len(items), len(name)) + name
    except struct.error:
        raise DispatchFileError(f"batch id {batch_id!r} is not an unsigned 64-bit int") from None
    return _entry(head, items.tobytes())


def encode_drop(batch_id: int, slots: np.ndarray | None) -> bytes:
    """One DROP entry; `slots` None is END (the whole batch)."""
    slots = np.empty(0, SLOT_DTYPE) if slots is None else slots
    try:
        head = _DROP.pack(KIND_DROP, batch_id, len(slots))
    except struct.error:
        raise DispatchFileError(f"batch id {batch_id!r} is not an unsigned 64-bit int") from None
    return _entry(head, slots.tobytes())


def read_leases(data: bytes) -> tuple[list[Lease], int]:
    """The live leases of a file's bytes (header already checked) and where its good part ends."""
    view = memoryview(data)
    items, item_batch, item_order = [], [], []
    slots, slot_batch, slot_order = [], [], []
    ends, end_order = [], []
    sessions: dict[int, str] = {}
    pos, order = HEADER_BYTES, 0
    while pos + _ENTRY.size < len(data):
        length, crc = _ENTRY.unpack_from(data, pos)
        body, end = pos + _ENTRY.size, pos + _ENTRY.size + length
        if not 0 < length <= MAX_ENTRY_BYTES or end > len(data):
            break
        if zlib.crc32(view[body:end]) != crc:
            break
        kind = data[body]
        if kind == KIND_LEASE and length >= _LEASE.size:
            _, batch_id, n, name_len = _LEASE.unpack_from(data, body)
            at = body + _LEASE.size + name_len
            if at + n * LEASE_DTYPE.itemsize != end:
                break
            try:
                sessions[batch_id] = data[body + _LEASE.size : at].decode("ascii")
            except UnicodeDecodeError:
                break
            items.append(np.frombuffer(data, LEASE_DTYPE, n, at))
            item_batch.append(batch_id)
            item_order.append(order)
        elif kind == KIND_DROP and length >= _DROP.size:
            _, batch_id, n = _DROP.unpack_from(data, body)
            if body + _DROP.size + n * SLOT_DTYPE.itemsize != end:
                break
            if n == 0:
                ends.append(batch_id)
                end_order.append(order)
            else:
                slots.append(np.frombuffer(data, SLOT_DTYPE, n, body + _DROP.size))
                slot_batch.append(batch_id)
                slot_order.append(order)
        else:
            break
        order += 1
        pos = end
    if not items:
        return [], pos
    counts = np.array([len(a) for a in items], np.int64)
    leased = np.concatenate(items)
    live = _live(
        leased,
        _Entries(np.array(item_batch, np.uint64), np.array(item_order, np.int64), counts),
        _Entries(
            np.array(slot_batch, np.uint64),
            np.array(slot_order, np.int64),
            np.array([len(a) for a in slots], np.int64),
        ),
        np.concatenate(slots) if slots else np.empty(0, SLOT_DTYPE),
        _Entries(np.array(ends, np.uint64), np.array(end_order, np.int64), None),
    )
    batch = np.repeat(np.array(item_batch, np.uint64), counts)[live]
    leased = leased[live]
    if not len(leased):
        return [], pos
    if np.any(batch[1:] < batch[:-1]):  # batch ids usually rise through the file
        by_batch = np.argsort(batch, kind="stable")
        leased, batch = leased[by_batch], batch[by_batch]
    cuts = np.flatnonzero(batch[1:] != batch[:-1]) + 1
    starts = [0, *cuts.tolist()]
    return [
        Lease(int(batch[start]), sessions[int(batch[start])], part)
        for start, part in zip(starts, np.split(leased, cuts), strict=True)
    ], pos


@dataclass(eq=False)
class _Entries:
    """One kind of entry, in file order: batch id, position in the file, rows each."""

    batch: np.ndarray  # u64
    order: np.ndarray  # i64, entry index in the file
    counts: np.ndarray | None  # i64, items or slots per entry


def _last_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys, and the index of the last row (in row order) holding each."""
    rows = np.argsort(keys, kind="stable")
    ordered = keys[rows]
    last = np.ones(len(keys), bool)
    last[:-1] = ordered[:-1] != ordered[1:]
    return ordered[last], rows[last]


def _live(leased, leases: _Entries, drops: _Entries, dropped, ends: _Entries) -> np.ndarray:
    """Which leased item rows no later entry resolves (vectorised: no per-item Python)."""
    u64, shift = np.uint64, np.uint64(32)
    n_leases, n_drops = len(leases.batch), len(drops.batch)
    rank = np.repeat(leases.order, leases.counts)  # rows are in file order
    # Batches numbered densely, per entry (few), so a (batch, slot) key fits in a u64.
    every = np.concatenate([leases.batch, drops.batch, ends.batch])
    ids, dense = np.unique(every, return_inverse=True)
    lease_id, drop_id, end_id = np.split(dense, [n_leases, n_leases + n_drops])
    ended = np.full(len(ids), -1, np.int64)  # the last END of each batch
    np.maximum.at(ended, end_id, ends.order)
    live = np.repeat(ended[lease_id] < leases.order, leases.counts)

    # A later LEASE of the same (segment, slot) wins. The writer puts one segment
    # in an entry, so segments are numbered per entry; per row if not (slower).
    starts = np.cumsum(leases.counts) - leases.counts
    entry_segment = np.zeros(n_leases, u64)
    some = leases.counts > 0
    entry_segment[some] = leased["segment"][starts[some]]
    if np.array_equal(np.repeat(entry_segment, leases.counts), leased["segment"]):
        segment = np.repeat(np.unique(entry_segment, return_inverse=True)[1], leases.counts)
    else:
        segment = np.unique(leased["segment"], return_inverse=True)[1]
    slot = leased["slot"].astype(u64)
    _, winners = _last_of_each((segment.astype(u64) << shift) | slot)
    superseded = np.ones(len(leased), bool)
    superseded[winners] = False
    live &= ~superseded

    if len(dropped):
        drop_key = (np.repeat(drop_id.astype(u64), drops.counts) << shift) | dropped.astype(u64)
        keys, last = _last_of_each(drop_key)
        last_rank = np.repeat(drops.order, drops.counts)[last]
        lease_key = (np.repeat(lease_id.astype(u64), leases.counts) << shift) | slot
        at = np.minimum(np.searchsorted(keys, lease_key), len(keys) - 1)
        live &= ~((keys[at] == lease_key) & (last_rank[at] > rank))
    return live


def check_dispatch_file(path: Path, epoch: int | None = None) -> list[str]:
    """Findings about a dispatch file at rest (after `close()`): an empty list when it is sound."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return [f"{path}: cannot read: {exc}"]
    header = parse_header(data)
    if header is None:
        return [f"{path}: bad header (magic, version, size or checksum)"]
    findings = []
    if epoch is not None and header[0] != epoch:
        findings.append(f"{path}: epoch {header[0]}, expected {epoch}")
    _, good = read_leases(data)
    if good != len(data):
        findings.append(f"{path}: {len(data) - good} bytes after the last good entry at {good}")
    return findings


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
        overhead = _ENTRY.size + _LEASE.size + len(session)
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
