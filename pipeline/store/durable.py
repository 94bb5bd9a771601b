"""Durable small writes: a directory's entries synced, a small file replaced whole or not at all.

Every module that creates, renames or removes a file it must not lose calls
these (segments, shards, job and store descriptions, marks), so the rule
lives in one place: data fsynced, renamed over the old name, the directory
fsynced. They raise OSError; callers translate it (`pipeline.store.segment.disk_error`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (created, renamed, removed files) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_whole(path: Path, data: bytes, also_sync: Iterable[Path] = ()) -> None:
    """Replace `path` with `data`, durably and atomically: a crash leaves the old file or the
    new one, never a part. `also_sync`: parent directories that are new themselves."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    for directory in (path.parent, *also_sync):
        fsync_dir(directory)
