"""The physical limits a storage benchmark is judged against, and page-cache control.

`RawWriter` and `write_bandwidth` measure what the disk gives a durable
sequential writer: pwrite into a preallocated file, fdatasync after every
chunk. `drop_cached` and `evict` take synced files out of the page cache:
between timed slices, so that a long run recycles the same memory (see
`RawWriter`), and before a cold-cache read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
SLICE_BYTES = 64 << 20  # write_bandwidth drops what it wrote after each slice of this size


def drop_cached(path: Path) -> None:
    """fdatasync `path`, then advise the kernel to drop its pages (mapped pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class RawWriter:
    """The disk's durable sequential write path with nothing on top: pwrite + fdatasync per chunk.

    The file is preallocated with posix_fallocate, as segments are, so both
    pay for converting unwritten extents. `write(n)` writes the next n chunks
    and returns the seconds spent in the writes; then, untimed, it drops
    them from the page cache. Without that, a long run keeps taking fresh
    memory, and on a VM whose balloon hands free memory back to the host the
    first touch of a fresh page can cost more than the disk write itself;
    a broker in steady state recycles its page cache instead.
    """

    def __init__(self, path: Path, chunk_bytes: int, chunks: int) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.chunks = chunks
        self._next = 0
        self.timings: list[float] = []  # seconds per chunk, pwrite + fdatasync
        self._payload = os.urandom(chunk_bytes)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(self._fd, 0, chunks * chunk_bytes)
        os.fdatasync(self._fd)

    def write(self, n: int) -> float:
        first, stop = self._next, min(self.chunks, self._next + n)
        started = time.perf_counter()
        for i in range(first, stop):
            begun = time.perf_counter()
            os.pwrite(self._fd, self._payload, i * self.chunk_bytes)
            os.fdatasync(self._fd)
            self.timings.append(time.perf_counter() - begun)
        seconds = time.perf_counter() - started
        self._next = stop
        span = (stop - first) * self.chunk_bytes
        os.posix_fadvise(self._fd, first * self.chunk_bytes, span, os.POSIX_FADV_DONTNEED)
        return seconds

    def close(self) -> None:
        """Close and remove the file. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


def write_bandwidth(path: Path, chunk_bytes: int, total_bytes: int) -> float:
    """Bytes per second of RawWriter over `total_bytes`; only the writes are timed."""
    writer = RawWriter(path, chunk_bytes, max(1, total_bytes // chunk_bytes))
    per_slice = max(1, SLICE_BYTES // chunk_bytes)
    try:
        seconds = sum(writer.write(per_slice) for _ in range(0, writer.chunks, per_slice))
    finally:
        writer.close()
    return writer.chunks * chunk_bytes / seconds


def evict(paths: list[Path]) -> str:
    """Drop `paths` from the page cache; return how, for the report.

    Every file is fdatasync'd and advised POSIX_FADV_DONTNEED; as root the
    whole page cache is also dropped through /proc/sys/vm/drop_caches.
    """
    for path in paths:
        drop_cached(path)
    how = "fdatasync + posix_fadvise(DONTNEED) per file"
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
    except OSError as exc:
        return f"{how}; /proc/sys/vm/drop_caches not writable ({exc.strerror}), so fadvise only"
    return f"{how}, then drop_caches=3"
