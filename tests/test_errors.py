"""The error families: what each is, so a handler catches only what it means to."""

from __future__ import annotations

import errno
from pathlib import Path

from pipeline.core.errors import DiskFullError, FabricError, SegmentError
from pipeline.store.segment import disk_error


def test_a_full_disk_is_not_a_segment_error():
    full = disk_error(OSError(errno.ENOSPC, "No space left on device"), Path("/d/x.seg"), "growing")
    assert isinstance(full, DiskFullError) and full.retryable
    assert isinstance(full, FabricError)
    assert not isinstance(full, SegmentError)  # `except SegmentError` (a damaged file) lets it by
    other = disk_error(OSError(errno.EIO, "Input/output error"), Path("/d/x.seg"), "growing")
    assert isinstance(other, SegmentError) and not isinstance(other, DiskFullError)
