"""Segment files: the append-only, memory-mapped log that is the queue.

`Segment` is one open file mapped onto numpy arrays (the byte layout is the
table in pipeline/store/segment_format.py). It creates files safely (temporary
name, space reserved, header synced, renamed), appends batches (slot written
and checksummed before its marker becomes LIVE), syncs them with one
fdatasync (group commit), retires slots with 4-byte DEAD stores, writes the
dispatch-owned attempts byte, verifies checksums and seals.

Slots are built in a reusable buffer and written with one pwrite per batch;
markers and counts are stored through the mapping, and every reader sees
slots through it (Linux has one page cache for both). Writing the slots
through the mapping instead made a durable 2 MiB batch about 27% slower:
fdatasync must write-protect every mapped dirty page, and first touches of
fresh mapped pages fault one page at a time (docs/segment-log.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import time
from pathlib import Path

import numpy as np

from pipeline.core.errors import (
    DiskFullError,
    SegmentError,
    SegmentFormatError,
    SegmentFullError,
    SegmentSealedError,
)
from pipeline.store.durable import fsync_dir
from pipeline.store.segment_format import (
    DEAD,
    DELETED_OFFSET,
    ENTRIES_OFFSET,
    HEADER_BYTES,
    LIVE,
    SEALED_NS_OFFSET,
    SEALED_OFFSET,
    SLOT_HEADER_BYTES,
    STATE_MASK,
    TMP_SUFFIX,
    SegmentHeader,
    SegmentKey,
    encode_header,
    parse_header,
    segment_file_name,
    slot_checksums,
    slot_dtype,
)


def disk_error(exc: OSError, path: Path, what: str) -> Exception:
    """Translate an OSError into DiskFullError (retryable) or SegmentError, naming the file."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"{path}: disk full while {what} ({exc.strerror}); free space under "
            f"{path.parent} and retry"
        )
    return SegmentError(f"{path}: {what} failed: {exc}")


class Segment:
    """One open segment file, mapped into memory.

    Opening takes a shared `flock` on the file, held until `close()`, so the
    collector (which needs the exclusive lock) never deletes a file in use.
    Only the process that created a segment may append to it, and only in
    that life: `open()` gives a handle for reading, tombstoning and sealing.
    """

    def __init__(self, path: Path, fd: int, header: SegmentHeader, writable: bool) -> None:
        self.path = path
        self.header = header
        self._fd = fd
        self._writable = writable
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._map = mmap.mmap(fd, header.file_bytes, access=access)
        buf = np.frombuffer(self._map, dtype=np.uint8)
        if not writable:
            buf = buf.view()
            buf.flags.writeable = False
        self._bytes = buf
        capacity = header.capacity
        self.markers = buf[HEADER_BYTES : HEADER_BYTES + capacity * 4].view("<u4")
        slot_region = buf[header.slots_offset : header.file_bytes]
        self.words = slot_region.view("<u4").reshape(capacity, header.slot_bytes // 4)
        self.slots = slot_region.view(slot_dtype(header.slot_bytes))
        self.bodies = slot_region.reshape(capacity, header.slot_bytes)[:, SLOT_HEADER_BYTES:]
        self._sealed = buf[SEALED_OFFSET : SEALED_OFFSET + 4].view("<u4")
        self._sealed_ns = buf[SEALED_NS_OFFSET : SEALED_NS_OFFSET + 8].view("<u8")
        self._entries = buf[ENTRIES_OFFSET : ENTRIES_OFFSET + 8].view("<u8")
        self._deleted = buf[DELETED_OFFSET : DELETED_OFFSET + 8].view("<u8")
        self._end: int | None = None  # next free slot; only for a segment created in this life
        self._stage: np.ndarray | None = None
        self._synced_end = 0
        self.last_append_s = time.monotonic()

    # ---- construction -------------------------------------------------
    @classmethod
    def create(
        cls,
        directory: Path,
        segment_id: int,
        key: SegmentKey,
        slot_bytes: int,
        capacity: int,
    ) -> Segment:
        """Create, preallocate and open a new segment for appending.

        The file is built under a temporary name, its space reserved with
        posix_fallocate (so a full disk fails here with DiskFullError, never
        later inside a mapped write), its header synced, and only then renamed
        into place.
        """
        if slot_bytes % 8 or slot_bytes <= SLOT_HEADER_BYTES:
            raise SegmentError(f"slot_bytes {slot_bytes} must be a multiple of 8 above 32")
        header = SegmentHeader(segment_id, key, slot_bytes, capacity, time.time_ns())
        directory = Path(directory)
        path = directory / segment_file_name(segment_id, key)
        tmp = directory / ("." + path.name + TMP_SUFFIX)
        if path.exists():
            raise SegmentError(
                f"{path}: segment id {segment_id} already exists; ids are never reused"
            )
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, header.file_bytes)
            os.pwrite(fd, encode_header(header), 0)
            os.fdatasync(fd)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(tmp, path)
            fsync_dir(directory)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise disk_error(exc, path, "creating a segment") from exc
        segment = cls(path, fd, header, writable=True)
        segment._end = 0
        return segment

    @classmethod
    def open(cls, path: Path | str, writable: bool = False) -> Segment:
        """Open an existing segment; SegmentFormatError if it is not a whole, valid file."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            header = parse_header(os.pread(fd, HEADER_BYTES, 0), path)
            size = os.fstat(fd).st_size
            if size != header.file_bytes:
                raise SegmentFormatError(
                    f"{path}: file is {size} bytes but its header describes {header.file_bytes} "
                    f"({header.capacity} slots of {header.slot_bytes} bytes)",
                    "wrong-size",
                )
            fcntl.flock(fd, fcntl.LOCK_SH)
            return cls(path, fd, header, writable)
        except BaseException:
            os.close(fd)
            raise

    # ---- properties ---------------------------------------------------
    @property
    def segment_id(self) -> int:
        return self.header.segment_id

    @property
    def key(self) -> SegmentKey:
        return self.header.key

    @property
    def capacity(self) -> int:
        return self.header.capacity

    @property
    def body_bytes(self) -> int:
        return self.header.slot_bytes - SLOT_HEADER_BYTES

    @property
    def sealed(self) -> bool:
        return bool(self._sealed[0])

    @property
    def sealed_ns(self) -> int:
        """Wall-clock time the segment was sealed; 0 while it is open."""
        return int(self._sealed_ns[0])

    @property
    def free_slots(self) -> int:
        """Slots left for appending; 0 for a segment not created in this life."""
        if self._end is None or self.sealed:
            return 0
        return self.capacity - self._end

    @property
    def entries(self) -> int:
        """Advisory count of slots made LIVE (a cache; recovery recounts it)."""
        return int(self._entries[0])

    @property
    def deleted(self) -> int:
        """Advisory count of slots made DEAD (a cache; recovery recounts it)."""
        return int(self._deleted[0])

    def states(self) -> np.ndarray:
        """The state byte of every marker (a new uint8 array)."""
        return (self.markers & STATE_MASK).astype(np.uint8)

    # ---- the writer's operations ------------------------------------------
    def append(
        self,
        seq: np.ndarray,
        job: np.ndarray,
        index: np.ndarray,
        count: np.ndarray,
        body: np.ndarray,
        flags: np.ndarray | None = None,
    ) -> int:
        """Append n items and make their markers LIVE; return the first slot.

        `flags` fills each slot's flags word (the completion log's result
        status); zero when not given.

        `body` is [n, k] of any dtype with k * itemsize <= body_bytes (tokens
        as uint32 for the input log, bytes for the completion log). Slots are
        written, checksummed, then marked LIVE, then the entry count moves.
        Nothing is durable until `sync()`. A failed write raises before any
        marker of the batch is LIVE.
        """
        n = len(seq)
        if self._end is None:
            raise SegmentSealedError(
                f"{self.path}: not created in this process life; open a new segment"
            )
        if self.sealed:
            raise SegmentSealedError(f"{self.path}: segment is sealed")
        if n > self.capacity - self._end:
            raise SegmentFullError(
                f"{self.path}: {n} items do not fit the {self.capacity - self._end} free slots"
            )
        rows = np.ascontiguousarray(body).reshape(n, -1).view(np.uint8)
        if rows.shape[1] > self.body_bytes:
            raise SegmentError(
                f"{self.path}: item body of {rows.shape[1]} bytes exceeds the slot body of "
                f"{self.body_bytes} bytes"
            )
        first, end = self._end, self._end + n
        slots = self._staging(n)
        slots["seq"] = seq
        slots["job"] = job
        slots["index"] = index
        slots["count"] = count
        slots["flags"] = 0 if flags is None else flags
        body_view = slots.view(np.uint8).reshape(n, -1)[:, SLOT_HEADER_BYTES:]
        body_view[:, : rows.shape[1]] = rows
        if rows.shape[1] < self.body_bytes:
            body_view[:, rows.shape[1] :] = 0
        words = slots.view("<u4").reshape(n, -1)
        slots["checksum"] = slot_checksums(words)
        offset = self.header.slots_offset + first * self.header.slot_bytes
        try:
            os.pwrite(self._fd, slots.view(np.uint8).reshape(-1), offset)
        except OSError as exc:
            raise disk_error(exc, self.path, "writing slots") from exc
        self.markers[first:end] = LIVE
        self._end = end
        self._entries[0] = end
        self.last_append_s = time.monotonic()
        return first

    def _staging(self, n: int) -> np.ndarray:
        """A reusable buffer of n slots, where a batch is built before one pwrite."""
        if self._stage is None or len(self._stage) < n:
            self._stage = np.empty(n, dtype=self.slots.dtype)
        return self._stage[:n]

    def seal(self) -> None:
        """Mark the segment closed for appends (durable at the next sync)."""
        self._sealed_ns[0] = time.time_ns()
        self._sealed[0] = 1

    def sync(self, drop_pages: bool = False) -> None:
        """Make every write durable: one fdatasync for the batch.

        With `drop_pages`, the slots appended since the last sync then leave the
        page cache (POSIX_FADV_DONTNEED on just that range).
        """
        end = self._end
        self.fdatasync()
        self.synced(end, drop_pages)

    def fdatasync(self) -> None:
        """The fdatasync alone: durable is every write that returned before this was called.

        It touches only the file descriptor, so another thread may call it while the owner
        appends (a writer's sync thread, router/sync_thread.py); the owner must not close the
        segment until it returns, and calls `synced()` afterwards on its own thread.
        """
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise disk_error(exc, self.path, "syncing") from exc

    def synced(self, end: int | None, drop_pages: bool = False) -> None:
        """Bookkeeping after an fdatasync that began once slots ..`end` were written (the
        value of `end_slot` then): with `drop_pages`, those slots leave the page cache."""
        if end is not None and end > self._synced_end:
            if drop_pages:
                slot_bytes = self.header.slot_bytes
                start = self.header.slots_offset + self._synced_end * slot_bytes
                os.posix_fadvise(
                    self._fd,
                    start,
                    (end - self._synced_end) * slot_bytes,
                    os.POSIX_FADV_DONTNEED,
                )
            self._synced_end = end

    @property
    def end_slot(self) -> int | None:
        """The next free slot (None for a segment not created in this life)."""
        return self._end

    def release_slots(self, first: int, last: int) -> None:
        """Unmap this process's pages of slots first..last (the file and its data stay).

        For readers done with a range (dispatch after handing it out, delivery
        after a page is acknowledged): the pages leave this process's resident
        set instead of accumulating there; the kernel keeps or drops the page
        cache as it likes. Only whole pages inside the range are released.
        """
        slot_bytes = self.header.slot_bytes
        start = self.header.slots_offset + first * slot_bytes
        end = self.header.slots_offset + (last + 1) * slot_bytes
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = end // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # ---- the completion stage's and dispatch's operations -------------------
    def tombstone(self, slots: np.ndarray) -> int:
        """Retire LIVE slots with 4-byte DEAD stores, then move the deleted count.

        Slots already DEAD are skipped (a duplicate retire); a slot that was
        never written is refused. Returns how many slots became DEAD.
        Durable at the next sync.
        """
        slots = np.sort(np.asarray(slots, dtype=np.int64))
        if len(slots) == 0:
            return 0
        if len(slots) > 1:  # drop repeats (np.unique is 20x slower for this)
            slots = slots[np.concatenate(([True], slots[1:] != slots[:-1]))]
        if slots[0] < 0 or slots[-1] >= self.capacity:
            raise SegmentError(
                f"{self.path}: slot out of range 0..{self.capacity - 1} in tombstone batch"
            )
        states = self.markers[slots] & STATE_MASK
        bad = slots[(states != LIVE) & (states != DEAD)]
        if len(bad):
            raise SegmentError(
                f"{self.path}: cannot retire slot {int(bad[0])}: marker state "
                f"{int(self.markers[bad[0]] & STATE_MASK)} is not LIVE"
            )
        live = slots[states == LIVE]
        self.markers[live] = DEAD
        self._deleted[0] += np.uint64(len(live))
        return len(live)

    def set_attempts(self, slots: np.ndarray, attempts: np.ndarray) -> None:
        """Write the attempts byte of each marker: a single-byte store that cannot undo a retire."""
        marker_bytes = self._bytes[HEADER_BYTES : HEADER_BYTES + self.capacity * 4]
        marker_bytes[np.asarray(slots, dtype=np.int64) * 4 + 1] = np.minimum(attempts, 255)

    def attempts(self, slots: np.ndarray) -> np.ndarray:
        return ((self.markers[slots] >> 8) & 0xFF).astype(np.uint8)

    # ---- readers -----------------------------------------------------------
    def verify(self, slots: np.ndarray) -> np.ndarray:
        """True for each slot whose stored checksum matches its content."""
        slots = np.asarray(slots, dtype=np.int64)
        return slot_checksums(self.words[slots]) == self.slots["checksum"][slots]

    def write_counts(self, entries: int, deleted: int) -> None:
        """Rewrite the advisory counts (recovery and check --fix only)."""
        self._entries[0] = entries
        self._deleted[0] = deleted

    def close(self) -> None:
        """Unmap and close; releases the shared lock. Idempotent."""
        if self._fd < 0:
            return
        self.markers = self.words = self.slots = self.bodies = None  # type: ignore[assignment]
        self._sealed = self._sealed_ns = self._entries = self._deleted = self._bytes = None  # type: ignore[assignment]
        # If a caller still holds a view, the mapping goes when that view does.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.path.name}, capacity={self.capacity})"
