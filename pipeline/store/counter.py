"""A durable counter shared by processes: ids that increase and are never reused."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from pipeline.store.segment import disk_error


class DurableCounter:
    """`next()` returns a fresh number; the following one is on disk before it returns.

    The file holds the lowest number not yet handed out, as fixed-width text
    rewritten in place (no truncate, so a full disk cannot leave it empty),
    under an exclusive flock.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def next(self, floor: int = 1, count: int = 1) -> int:
        """A number >= `floor` that was never handed out before; with `count`, the first of
        `count` such numbers in a row (a block reserved at once)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise disk_error(exc, self.path, "allocating an id") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            number = max(int(text) if text.isdigit() else 1, floor)
            os.pwrite(fd, f"{number + count:020d}\n".encode(), 0)
            os.fsync(fd)
            return number
        except OSError as exc:
            raise disk_error(exc, self.path, "allocating an id") from exc
        finally:
            os.close(fd)
