"""Isolating a damaged input segment: serve what can be trusted, move the file aside.

A scan that finds an input segment it cannot read as a whole (truncated, a
damaged header) reports a `DamagedFile` (pipeline/store/scan.py). Left in place,
nothing of it would ever be served and its job would never end. At broker
start, with the data dir locked and before any stage runs, `isolate()`:

1. Finds the layout it can trust. A header whose checksum holds is trusted.
   A header whose checksum fails is trusted only where a second source agrees
   with it: segment id, kind, shape and lane must match the file name, and
   slot size and capacity must give exactly the file's size (a damaged
   header on a truncated file has no second source: nothing is trusted).
   An input segment's model is taken from its file name, which spells it
   whole (a model's name is made of file-safe characters only,
   config/rules.py): a damaged byte of the header's name field (a letter,
   or its NUL padding) costs nothing, and no item is served under a name
   the damage made up. The creation time has no second source and nothing
   needs it: it is kept as read.
2. Reads the slots it can trust: inside the file, marker exactly LIVE (state
   LIVE, attempts byte anything, upper bytes zero: docs/segment-log.md),
   checksum valid, and seq agreeing with the slot's job and index.
3. Appends those items to a new input segment of the same key (new id, same
   slot size), syncs and seals it; only then
4. moves the damaged file into `<data_dir>/damaged/` (rename, both
   directories synced), where `status`, `check` and the metrics report it.

A crash between 3 and 4 leaves the items twice in the log; the next start
copies them again and completion drops the duplicate results (invariant 5).
Items of the damaged file that could not be read are not guessed at here:
they are acknowledged items with no readable slot and no result, which the
loss accounting (collector/losses.py) turns into `corrupt_input` error
results, from the jobs' chunk journals. Attempt counts of the copied items
start again at zero.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import SegmentFormatError
from pipeline.core.item_seq import consistent
from pipeline.store.datadir import DataDir
from pipeline.store.durable import fsync_dir
from pipeline.store.scan import SLOT_CHUNK_BYTES, DamagedFile
from pipeline.store.segment import Segment
from pipeline.store.segment_append import SegmentIds
from pipeline.store.segment_format import (
    CHECKSUM_WORD,
    HEADER_BYTES,
    HEADER_CHECKED,
    KIND_INPUT,
    LIVE,
    NAME_BYTES,
    SLOT_HEADER_BYTES,
    STATE_MASK,
    SegmentHeader,
    SegmentKey,
    live_markers,
    parse_header,
    parse_segment_file_name,
    segment_file_model,
    segment_file_name,
    slot_checksums,
)

log = logging.getLogger("fabric.salvage")

_FIELDS = struct.Struct("<8sIIQIIIIQ64s")
# Codes of damage worth isolating. A file of a newer version is whole: it is left alone.
ISOLATED_CODES = ("wrong-size", "bad-header", "bad-magic", "unreadable")


@dataclass(frozen=True)
class Isolated:
    """What isolating one damaged file did."""

    path: Path  # where the damaged file is now (under damaged/)
    code: str
    copied: int  # trusted items now in `into`
    into: Path | None  # the new segment holding them (None when nothing was readable)
    trusted_layout: bool


def trusted_header(path: Path, raw: bytes, size: int) -> SegmentHeader | None:
    """The layout of a damaged file, where it can be trusted (module docstring, step 1)."""
    try:
        return parse_header(raw, path)
    except SegmentFormatError:
        pass
    named = parse_segment_file_name(path.name)
    if named is None or len(raw) < HEADER_CHECKED:
        return None
    _, _, kind, seg_id, shape, lane, slot_bytes, capacity, created, name = _FIELDS.unpack_from(raw)
    if (kind, seg_id, shape, lane) != named:
        return None
    if slot_bytes % 8 or slot_bytes <= SLOT_HEADER_BYTES or capacity < 1:
        return None
    model = name.rstrip(b"\0").decode("utf-8", "replace")
    if kind == KIND_INPUT:  # its file name spells the model whole: trust no damaged name field
        model = segment_file_model(path.name) or ""
    if not model or len(model.encode()) > NAME_BYTES:
        return None
    key = SegmentKey(kind, model, shape, lane)
    if segment_file_name(seg_id, key) != path.name:
        return None
    header = SegmentHeader(seg_id, key, slot_bytes, capacity, created)
    return header if header.file_bytes == size else None


def iter_slots(fd: int, header: SegmentHeader, size: int, wanted):
    """Chunks (slots, markers, words, trusted) of the slots on disk whose marker state
    `wanted(states)` selects; `trusted`: checksum valid, seq not 0 and agreeing with the
    slot's job and index. Only slots whose marker and content both lie inside the file."""
    markers_on_disk = max(0, min(header.capacity, (size - HEADER_BYTES) // 4))
    slots_on_disk = max(0, min(header.capacity, (size - header.slots_offset) // header.slot_bytes))
    usable = min(markers_on_disk, slots_on_disk)
    step = max(1, SLOT_CHUNK_BYTES // header.slot_bytes)
    for first in range(0, usable, step):
        count = min(step, usable - first)
        markers = np.frombuffer(os.pread(fd, count * 4, HEADER_BYTES + first * 4), "<u4")
        pick = np.flatnonzero(wanted(markers & STATE_MASK))
        if len(pick) == 0:
            continue
        lo, hi = int(pick[0]), int(pick[-1]) + 1
        raw = os.pread(
            fd,
            (hi - lo) * header.slot_bytes,
            header.slots_offset + (first + lo) * header.slot_bytes,
        )
        words = np.frombuffer(raw, "<u4").reshape(-1, header.slot_bytes // 4)[pick - lo]
        seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        job = np.ascontiguousarray(words[:, 2:4]).view("<u8").reshape(-1)
        ok = (slot_checksums(words) == words[:, CHECKSUM_WORD]) & consistent(seq, job, words[:, 4])
        yield first + pick, markers[pick], words, ok


def trusted_items(fd: int, header: SegmentHeader, size: int) -> np.ndarray:
    """The trusted LIVE slots of a file (module docstring, step 2) as [n, slot_words] u32."""
    found = [
        words[ok & live_markers(markers)]
        for _, markers, words, ok in iter_slots(fd, header, size, lambda states: states == LIVE)
    ]
    if not found:
        return np.empty((0, header.slot_bytes // 4), np.uint32)
    return np.concatenate(found)


def isolate(data_dir: DataDir, damaged: DamagedFile) -> Isolated | None:
    """Copy the trusted items of a damaged input segment to a new one; move the file aside.

    None for a file this does not isolate: not an input segment, or damage that is
    no damage (a newer format version).
    """
    path = damaged.path
    if damaged.code not in ISOLATED_CODES or path.parent != data_dir.segments:
        return None
    named = parse_segment_file_name(path.name)
    if named is None or named[0] != KIND_INPUT:
        return None
    header = None
    words = np.empty((0, 1), np.uint32)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            size = os.fstat(fd).st_size
            header = trusted_header(path, os.pread(fd, HEADER_BYTES, 0), size)
            if header is not None:
                words = trusted_items(fd, header, size)
        finally:
            os.close(fd)
    into = None
    if header is not None and len(words):
        into = _copy(data_dir, header, words)
    aside = data_dir.damaged / path.name
    if not data_dir.damaged.is_dir():
        data_dir.damaged.mkdir()
        fsync_dir(data_dir.root)  # its name, before a file is moved into it
    os.rename(path, aside)
    fsync_dir(data_dir.damaged)
    fsync_dir(data_dir.segments)
    log.error(
        "damaged segment isolated to %s (%s): %d trusted item(s) copied to %s; the rest "
        "become corrupt_input error results",
        aside,
        damaged.code,
        len(words) if into else 0,
        into.name if into else "nothing",
    )
    return Isolated(aside, damaged.code, len(words) if into else 0, into, header is not None)


def _copy(data_dir: DataDir, header: SegmentHeader, words: np.ndarray) -> Path:
    """Append the trusted slots to a new sealed input segment of the same key; durable."""
    ids = SegmentIds(data_dir)
    segment = Segment.create(
        data_dir.segments, ids.allocate(), header.key, header.slot_bytes, len(words)
    )
    try:
        seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        job = np.ascontiguousarray(words[:, 2:4]).view("<u8").reshape(-1)
        body = np.ascontiguousarray(words[:, SLOT_HEADER_BYTES // 4 :])
        segment.append(seq, job, words[:, 4].copy(), words[:, 5].copy(), body)
        segment.seal()
        segment.sync()
        return segment.path
    finally:
        segment.close()


def isolated_files(data_dir: DataDir) -> list[Path]:
    """The damaged files moved aside so far."""
    if not data_dir.damaged.is_dir():
        return []
    return sorted(p for p in data_dir.damaged.iterdir() if p.is_file())
