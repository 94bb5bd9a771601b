"""Reading a segment file from its markers alone, as recovery and check do.

A scan reads the header and the marker column with `pread` in bounded
chunks (so memory does not grow with the backlog), counts the states,
finds the first LIVE slot and the end of the written region, and looks for a
torn tail: LIVE slots past the last good one whose checksum fails. Those
were never acknowledged (the writer acknowledges only after one fdatasync
covering slots and markers), so repairing cuts them back to EMPTY. Rot can
look the same: a cut slot that held an acknowledged item is found by the
loss accounting after recovery (collector/losses.py) and ends as a
`corrupt_input` error result, never silently.

It never trusts the header's advisory counts; it reports them so that check
can say when they disagree, and a repairing scan rewrites them.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import SegmentFormatError
from pipeline.store.segment_format import (
    CHECKSUM_WORD,
    DEAD,
    DELETED_OFFSET,
    EMPTY,
    ENTRIES_OFFSET,
    HEADER_BYTES,
    LIVE,
    SEALED_NS_OFFSET,
    SEALED_OFFSET,
    STATE_MASK,
    SegmentHeader,
    SegmentKey,
    known_markers,
    live_markers,
    parse_header,
    slot_checksums,
)

MARKER_CHUNK = 1 << 18  # markers per read: 1 MiB
SLOT_CHUNK_BYTES = 1 << 22  # bytes of slots per read when verifying


@dataclass(frozen=True)
class SegmentSummary:
    """What a scan found in one well-formed segment file."""

    path: Path
    header: SegmentHeader
    live: int
    dead: int
    unknown: int  # markers in no known state (never dispatched, never finished)
    first_live: int  # -1 when no slot is LIVE
    end: int  # one past the last slot that is not EMPTY
    sealed: bool
    header_entries: int  # the advisory counts as found, before any rewrite
    header_deleted: int
    torn: tuple[int, ...]  # tail slots with a LIVE marker and a bad checksum
    repaired: bool  # torn slots cut, counts rewritten and the segment sealed

    @property
    def segment_id(self) -> int:
        return self.header.segment_id

    @property
    def key(self) -> SegmentKey:
        return self.header.key

    @property
    def entries(self) -> int:
        return self.live + self.dead + self.unknown

    @property
    def finished(self) -> bool:
        """Sealed with nothing LIVE and nothing unreadable: the collector may remove it."""
        return self.sealed and self.live == 0 and self.unknown == 0


@dataclass(frozen=True)
class DamagedFile:
    """A file in a segment directory that cannot be read as a segment."""

    path: Path
    code: str
    reason: str


def read_slots(fd: int, header: SegmentHeader, first: int, count: int) -> np.ndarray:
    """Slots first..first+count as a [count, slot_words] uint32 array (a copy)."""
    raw = os.pread(fd, count * header.slot_bytes, header.slots_offset + first * header.slot_bytes)
    return np.frombuffer(raw, dtype="<u4").reshape(count, header.slot_bytes // 4)


def iter_markers(fd: int, header: SegmentHeader):
    """Yield (first_slot, markers) chunks of the marker column."""
    for first in range(0, header.capacity, MARKER_CHUNK):
        count = min(MARKER_CHUNK, header.capacity - first)
        raw = os.pread(fd, count * 4, HEADER_BYTES + first * 4)
        yield first, np.frombuffer(raw, dtype="<u4")


def _read_states(fd: int, first: int, count: int) -> np.ndarray:
    raw = os.pread(fd, count * 4, HEADER_BYTES + first * 4)
    return np.frombuffer(raw, dtype="<u4") & STATE_MASK


def _torn_tail(fd: int, header: SegmentHeader, end: int) -> list[int]:
    """Walk back from `end` over LIVE slots whose checksum fails; stop at a good or DEAD one.

    Reads the states first, and slots only where a LIVE one must be checked,
    in chunks that start small (the usual answer is the very last slot).
    """
    torn: list[int] = []
    stop, step = end, 8
    limit = max(1, SLOT_CHUNK_BYTES // header.slot_bytes)
    while stop > 0:
        start = max(0, stop - step)
        states = _read_states(fd, start, stop - start)
        written = np.flatnonzero(states != EMPTY)
        if len(written) and states[written[-1]] != LIVE:
            return torn  # the last written slot is retired: nothing after it is torn
        if len(written):
            words = read_slots(fd, header, start, stop - start)
            good = slot_checksums(words) == words[:, CHECKSUM_WORD]
            for i in written[::-1].tolist():
                if states[i] != LIVE or good[i]:
                    return torn
                torn.append(start + i)
        stop, step = start, min(limit, step * 8)
    return torn


def scan_segment(path: Path, repair: bool = False) -> SegmentSummary | DamagedFile:
    """Scan one segment file; with `repair`, cut its torn tail, recount and seal it."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR if repair else os.O_RDONLY)
    except OSError as exc:
        return DamagedFile(path, "unreadable", f"{path}: cannot open: {exc.strerror}")
    try:
        try:
            header = parse_header(os.pread(fd, HEADER_BYTES, 0), path)
        except SegmentFormatError as exc:
            return DamagedFile(path, exc.code, str(exc))
        size = os.fstat(fd).st_size
        if size != header.file_bytes:
            return DamagedFile(
                path,
                "wrong-size",
                f"{path}: file is {size} bytes but its header describes {header.file_bytes}",
            )
        return _scan(fd, path, header, repair)
    finally:
        os.close(fd)


def _scan(fd: int, path: Path, header: SegmentHeader, repair: bool) -> SegmentSummary:
    live = dead = unknown = 0
    first_live = end = -1
    for first, markers in iter_markers(fd, header):
        states = markers & STATE_MASK
        is_live = live_markers(markers)  # an unknown marker reading LIVE is not LIVE
        known = known_markers(markers)
        n_live = int(np.count_nonzero(is_live))
        live += n_live
        dead += int(np.count_nonzero(states == DEAD))
        unknown += int(np.count_nonzero(~known))
        if n_live and first_live < 0:
            first_live = first + int(np.argmax(is_live))
        written = np.flatnonzero(states != EMPTY)
        if len(written):
            end = first + int(written[-1])
    end += 1
    meta = os.pread(fd, HEADER_BYTES, 0)
    (sealed,) = struct.unpack_from("<I", meta, SEALED_OFFSET)
    (entries,) = struct.unpack_from("<Q", meta, ENTRIES_OFFSET)
    (deleted,) = struct.unpack_from("<Q", meta, DELETED_OFFSET)

    torn = _torn_tail(fd, header, end) if live else []
    live -= len(torn)
    if torn and live == 0:
        first_live = -1
    if torn:
        end = _last_written_below(fd, header, min(torn)) + 1

    changed = False
    if repair:
        for slot in torn:
            os.pwrite(fd, b"\0\0\0\0", HEADER_BYTES + slot * 4)
        new_entries, new_deleted = live + dead + unknown, dead
        if (sealed, entries, deleted) != (1, new_entries, new_deleted) or torn:
            if not sealed:
                os.pwrite(fd, struct.pack("<Q", time.time_ns()), SEALED_NS_OFFSET)
            os.pwrite(fd, struct.pack("<I", 1), SEALED_OFFSET)
            os.pwrite(fd, struct.pack("<Q", new_entries), ENTRIES_OFFSET)
            os.pwrite(fd, struct.pack("<Q", new_deleted), DELETED_OFFSET)
            os.fdatasync(fd)
            changed = True
        sealed = 1
    return SegmentSummary(
        path=path,
        header=header,
        live=live,
        dead=dead,
        unknown=unknown,
        first_live=first_live,
        end=end,
        sealed=bool(sealed),
        header_entries=entries,
        header_deleted=deleted,
        torn=tuple(sorted(torn)),
        repaired=changed,
    )


def _last_written_below(fd: int, header: SegmentHeader, limit: int) -> int:
    """Index of the last non-EMPTY marker below `limit`, or -1."""
    stop = limit
    while stop > 0:
        start = max(0, stop - MARKER_CHUNK)
        written = np.flatnonzero(_read_states(fd, start, stop - start))
        if len(written):
            return start + int(written[-1])
        stop = start
    return -1


def bad_live_slots(fd: int, header: SegmentHeader, end: int) -> np.ndarray:
    """Every LIVE slot below `end` whose checksum fails (a full read: check only)."""
    bad: list[np.ndarray] = []
    step = max(1, SLOT_CHUNK_BYTES // header.slot_bytes)
    for start in range(0, end, step):
        count = min(step, end - start)
        is_live = _read_states(fd, start, count) == LIVE
        if not is_live.any():
            continue
        words = read_slots(fd, header, start, count)
        failed = is_live & (slot_checksums(words) != words[:, CHECKSUM_WORD])
        if failed.any():
            bad.append(start + np.flatnonzero(failed))
    return np.concatenate(bad) if bad else np.empty(0, dtype=np.int64)
