"""A bounded single-producer single-consumer byte ring in POSIX shared memory.

Stages hand batches to the next stage through a ring: the producer copies a
few numpy arrays into one record (one copy each), the consumer reads them in
place (zero copies) and releases the space. ZeroMQ carries only the record's
positions (an ITEM_BATCH descriptor, see pipeline/transport/wire/messages.py). The ring never
grows: when it is full `put()` returns None and the producer backs off, so a
slow consumer pushes back on its producers instead of growing memory.

Shared-memory object `/<name>` (all integers little-endian):

| offset | size     | field        | meaning                                        | owner    |
|--------|----------|--------------|------------------------------------------------|----------|
| 0      | 8        | magic        | b"IFRING1\\0", written last by create()         | creator  |
| 8      | 4        | version      | layout version, 1                              | creator  |
| 12     | 4        | header_bytes | 4096: where the data area starts               | creator  |
| 16     | 8        | capacity     | data area bytes, a multiple of 8               | creator  |
| 24     | 8        | created_ns   | wall-clock creation time                       | creator  |
| 32     | 4        | creator_pid  | pid of the process that created the ring       | creator  |
| 128    | 8        | head         | u64 bytes ever published (monotonic)           | producer |
| 256    | 8        | tail         | u64 bytes ever released (monotonic)            | consumer |
| 4096   | capacity | data         | records, at position % capacity                | producer |

`head` and `tail` sit in separate 128-byte blocks (a cache line on x86-64
plus its adjacent-line prefetch pair, and a whole line on Apple aarch64), so
the two sides never write the same line. `head - tail` is the bytes in use.

Record (8-byte aligned; it never straddles the end of the data area):

| offset | size   | field   | meaning                                               |
|--------|--------|---------|-------------------------------------------------------|
| 0      | 4      | length  | payload bytes (the record takes 8 + align8(length))   |
| 4      | 4      | kind    | caller's record kind; 0xFFFFFFFF is the wrap marker   |
| 8      | length | payload | put(): each array's bytes, each starting 8-aligned    |

A record that would not fit before the end of the data area is preceded by
a wrap marker (kind 0xFFFFFFFF, length 0) at the current position and
starts at offset 0; the bytes skipped count as used until the consumer
passes them. A record is at most capacity / 2 bytes, so even the worst wrap
fits into an empty ring and a put always succeeds eventually.

Memory ordering. Each counter is one aligned 8-byte store by its single
owner (a numpy u64 element store), and one aligned load by the other side;
on x86-64 and aarch64 such accesses are single-copy atomic, so neither side
ever sees a torn counter. The producer writes the record (header and
payload) before it publishes `head`; the consumer reads `head` before it
reads the record, and finishes reading before it publishes `tail`. x86-64
(TSO) keeps stores in order with stores and loads in order with loads, which
is all this needs, so no fence is executed there. Elsewhere (aarch64) the
handle puts a fence between the two steps, built from a private lock: a
release followed by an acquire is an atomic release followed by an atomic
acquire in CPython (a sem_t in 3.11-3.12, a PyMutex from 3.13), and on
aarch64 that pair orders every access before it against every access after
it. This path is argued, not tested here: our CI runs on x86-64.

A ring survives the death of either side: records published and not yet
released are still there when the consumer's replacement attaches, and it
reads them again (at-least-once; a writer appends an item of a chunk's try once,
docs/ingest.md "Exactly once into the log"). A
producer that dies between reserve() and commit() published nothing. The
supervisor owns the ring's life: create() at start, unlink() at shutdown.
A handle belongs to one thread.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import threading
import time

import numpy as np
import posix_ipc

from pipeline.core.errors import RingError
from pipeline.transport.ring_layout import align8, record_layout
from pipeline.transport.ring_names import check_name

MAGIC = b"IFRING1\0"
VERSION = 1
HEADER_BYTES = 4096
HEAD_OFFSET = 128
TAIL_OFFSET = 256
RECORD_HEADER_BYTES = 8
WRAP_KIND = 0xFFFFFFFF
MIN_CAPACITY_BYTES = 256

_HEADER = struct.Struct("<8sIIQQI")  # magic .. creator_pid
_RECORD = struct.Struct("<II")  # length, kind
_HEAD_WORD = HEAD_OFFSET // 8
_TAIL_WORD = TAIL_OFFSET // 8
_NEEDS_FENCE = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686", "x86"}


class _Fence:
    """A full memory barrier from a lock this handle always holds (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def __call__(self) -> None:
        self._lock.release()
        self._lock.acquire()


class Ring:
    """One mapping of a ring; used as its producer, its consumer, or to observe it.

    Build with `Ring.create()` (the supervisor) or `Ring.attach()` (a stage).
    """

    def __init__(self, name: str, mm: mmap.mmap, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._mm: mmap.mmap | None = mm
        self._view = memoryview(mm)
        self._readonly = self._view.toreadonly()
        self._words = np.frombuffer(mm, np.uint64, count=HEADER_BYTES // 8)
        self._data = np.frombuffer(mm, np.uint8, count=capacity_bytes, offset=HEADER_BYTES)
        self._fence = _Fence() if _NEEDS_FENCE else None
        # Producer side: our head, the tail last seen, a reservation (payload offset, new head).
        self._head = int(self._words[_HEAD_WORD])
        self._tail_seen = int(self._words[_TAIL_WORD])
        self._pending: tuple[int, int] | None = None
        # Consumer side: the next unread position, the head last seen, the tail we published.
        self._tail = self._tail_seen
        self._read = self._tail_seen
        self._head_seen = self._tail_seen

    # ---- life ----------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, capacity_bytes: int) -> Ring:
        """Create an empty ring, first unlinking a stale one of the same name.

        Every page is allocated now, so a full /dev/shm fails here with RingError
        instead of a SIGBUS inside a later put().
        """
        check_name(name)
        if (
            not isinstance(capacity_bytes, int)
            or capacity_bytes < MIN_CAPACITY_BYTES
            or capacity_bytes % 8
        ):
            raise RingError(
                f"ring {name}: capacity_bytes {capacity_bytes!r} must be an int multiple of 8, "
                f"at least {MIN_CAPACITY_BYTES}"
            )
        Ring.unlink(name)
        size = HEADER_BYTES + capacity_bytes
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        except (posix_ipc.Error, OSError) as exc:
            raise RingError(
                f"ring {name}: cannot create {size} bytes of shared memory: {exc}"
            ) from exc
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(shm.fd, 0, size)
            mm = mmap.mmap(shm.fd, size)
        except OSError as exc:
            shm.close_fd()
            Ring.unlink(name)
            raise RingError(
                f"ring {name}: cannot allocate {size} bytes in /dev/shm ({exc}); "
                "free space there or lower the ring's capacity"
            ) from exc
        shm.close_fd()
        _HEADER.pack_into(
            mm, 0, b"\0" * 8, VERSION, HEADER_BYTES, capacity_bytes, time.time_ns(), os.getpid()
        )
        mm[0:8] = MAGIC
        return cls(name, mm, capacity_bytes)

    @classmethod
    def attach(cls, name: str) -> Ring:
        """Map an existing ring; RingError if it is missing or not a ring of this version."""
        check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise RingError(
                f"ring {name} does not exist; the supervisor creates rings before it starts stages"
            ) from exc
        except (posix_ipc.Error, OSError) as exc:
            raise RingError(f"ring {name}: cannot open: {exc}") from exc
        try:
            if shm.size < HEADER_BYTES:
                raise RingError(f"ring {name} is {shm.size} bytes, smaller than its header")
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        magic, version, header_bytes, capacity, _, _ = _HEADER.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"bad magic {magic!r} (want {MAGIC!r}): not a ring, or create() is unfinished"
        elif version != VERSION or header_bytes != HEADER_BYTES:
            problem = (
                f"layout version {version}, header {header_bytes} bytes; this code reads {VERSION}"
            )
        elif capacity % 8 or HEADER_BYTES + capacity != len(mm):
            problem = f"capacity {capacity} disagrees with its size {len(mm)}"
        if problem is not None:
            mm.close()
            raise RingError(f"ring {name}: {problem}")
        return cls(name, mm, capacity)

    def close(self) -> None:
        """Unmap. Views still held from get() or reserve() keep the mapping alive until dropped."""
        mm = self._mm
        if mm is None:
            return
        self._mm = None
        self._words = self._data = None
        try:
            self._readonly.release()
            self._view.release()
            mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the last one does

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the ring's name; mappings stay valid until closed. True if it existed."""
        check_name(name)
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            return False
        return True

    @staticmethod
    def created_ns_of(name: str) -> int | None:
        """The creation time in the header of the ring called `name` (None if there is none),
        read without mapping it: how a stage notices its ring was replaced."""
        check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            return None
        try:
            raw = os.pread(shm.fd, _HEADER.size, 0)
        finally:
            shm.close_fd()
        return _HEADER.unpack(raw)[4] if len(raw) == _HEADER.size else None

    # ---- state ---------------------------------------------------------------------------

    @property
    def head(self) -> int:
        """Bytes ever published (the producer's counter); a record's start is head before put()."""
        self._check_open()
        return int(self._words[_HEAD_WORD])

    @property
    def tail(self) -> int:
        """Bytes ever released (the consumer's counter)."""
        self._check_open()
        return int(self._words[_TAIL_WORD])

    @property
    def created_ns(self) -> int:
        """When create() made this ring; a replacement under the same name has another value."""
        self._check_open()
        return int(self._words[3])

    @property
    def creator_pid(self) -> int:
        """The process that created the ring: a broker's supervisor creates every ring of its
        life, so a replacement by another process means another broker life."""
        self._check_open()
        return int(_HEADER.unpack_from(self._view, 0)[5])

    @property
    def used_bytes(self) -> int:
        """Bytes published and not yet released, wrap gaps included."""
        tail = self.tail  # tail first: head read later is never behind it
        return self.head - tail

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def max_record_bytes(self) -> int:
        """The largest payload one record may carry."""
        return self.capacity_bytes // 2 - RECORD_HEADER_BYTES

    def _check_open(self) -> None:
        if self._mm is None:
            raise RingError(f"ring {self.name}: handle is closed")

    # ---- producer ------------------------------------------------------------------------

    def _reserve(self, kind: int, nbytes: int) -> int | None:
        """Claim room for a record; returns its payload's offset in the data area, or None."""
        self._check_open()
        if self._pending is not None:
            raise RingError(f"ring {self.name}: reserve() again before commit() or cancel()")
        if not isinstance(kind, int) or not 0 <= kind < WRAP_KIND:
            raise RingError(
                f"ring {self.name}: record kind {kind!r} must be an int in 0..{WRAP_KIND - 1}"
            )
        need = RECORD_HEADER_BYTES + align8(nbytes)
        capacity = self.capacity_bytes
        if nbytes < 0 or need > capacity // 2:
            raise RingError(
                f"ring {self.name}: a record of {nbytes} payload bytes ({need} with header) exceeds "
                f"half the ring's capacity of {capacity} bytes; split the batch or grow the ring"
            )
        head = self._head
        offset = head % capacity
        skip = capacity - offset if capacity - offset < need else 0
        total = skip + need
        if capacity - (head - self._tail_seen) < total:
            self._tail_seen = int(self._words[_TAIL_WORD])
            if capacity - (head - self._tail_seen) < total:
                return None
        if skip:
            _RECORD.pack_into(self._view, HEADER_BYTES + offset, 0, WRAP_KIND)
            offset = 0
        _RECORD.pack_into(self._view, HEADER_BYTES + offset, nbytes, kind)
        self._pending = (offset + RECORD_HEADER_BYTES, head + total)
        return offset + RECORD_HEADER_BYTES

    def reserve(self, kind: int, nbytes: int) -> memoryview | None:
        """A writable view of `nbytes` for the next record, or None while the ring is too full.

        Fill it, then commit(); do not touch the view after that.
        """
        start = self._reserve(kind, nbytes)
        if start is None:
            return None
        return self._view[HEADER_BYTES + start : HEADER_BYTES + start + nbytes]

    def commit(self) -> int:
        """Publish the reserved record; returns its end position (the new head)."""
        if self._pending is None:
            raise RingError(f"ring {self.name}: commit() without a reserve()")
        end = self._pending[1]
        if self._fence is not None:
            self._fence()  # the record's bytes before the head that publishes them
        self._words[_HEAD_WORD] = end
        self._head = end
        self._pending = None
        return end

    def cancel(self) -> None:
        """Drop an uncommitted reservation; nothing was published."""
        self._pending = None

    def put(self, kind: int, *arrays: np.ndarray | bytes) -> int | None:
        """Write the arrays' bytes as one record (one copy each); its end position, or None if full.

        Each array starts 8-byte aligned in the payload; read them back with
        `record_arrays()`. None means no room now: back off and try again later.
        """
        arrays = tuple(
            a if isinstance(a, np.ndarray) else np.frombuffer(a, np.uint8) for a in arrays
        )
        for array in arrays:
            if array.dtype.hasobject:
                raise RingError(
                    f"ring {self.name}: cannot put an array of dtype {array.dtype} (objects)"
                )
        offsets, nbytes = record_layout([a.nbytes for a in arrays])
        start = self._reserve(kind, nbytes)
        if start is None:
            return None
        data = self._data
        for array, offset in zip(arrays, offsets, strict=True):
            if not array.nbytes:
                continue
            dst = data[start + offset : start + offset + array.nbytes]
            if array.flags.c_contiguous:
                dst[:] = array.reshape(-1).view(np.uint8)
            else:
                np.copyto(dst.view(array.dtype).reshape(array.shape), array, casting="no")
        return self.commit()

    # ---- consumer ------------------------------------------------------------------------

    def get(self) -> tuple[int, memoryview] | None:
        """The next unread record as (kind, read-only payload view), or None if there is none.

        Views stay valid until release(). Release before waiting for more, or a
        full ring of unreleased records stalls both sides.
        """
        self._check_open()
        position = self._read
        if position == self._head_seen:
            self._head_seen = int(self._words[_HEAD_WORD])
            if position == self._head_seen:
                return None
            if self._fence is not None:
                self._fence()  # the head before the records it publishes
        capacity = self.capacity_bytes
        offset = position % capacity
        length, kind = _RECORD.unpack_from(self._view, HEADER_BYTES + offset)
        if kind == WRAP_KIND:
            position += capacity - offset
            offset = 0
            length, kind = _RECORD.unpack_from(self._view, HEADER_BYTES)
        end = position + RECORD_HEADER_BYTES + align8(length)
        if (
            kind == WRAP_KIND
            or end > self._head_seen
            or offset + RECORD_HEADER_BYTES + length > capacity
        ):
            raise RingError(
                f"ring {self.name}: record at position {position} (kind {kind}, length {length}) "
                f"runs past head {self._head_seen}; the ring is corrupt, recreate it"
            )
        self._read = end
        start = HEADER_BYTES + offset + RECORD_HEADER_BYTES
        return kind, self._readonly[start : start + length]

    def release(self) -> int:
        """Free every record get() has returned so far; returns the new tail."""
        self._check_open()
        if self._read != self._tail:
            if self._fence is not None:
                self._fence()  # done reading the records before the tail frees them
            self._words[_TAIL_WORD] = self._read
            self._tail = self._read
        return self._tail
