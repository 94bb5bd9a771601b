"""The segment file format: layout, header codec, slot dtype and checksum.

A segment holds items of exactly one key (model, shape, lane) for the input
log, or one job for the completion log. It is a header page, a column of
4-byte markers and a table of fixed-size slots, so the whole file maps onto
numpy arrays. All integers are little-endian.

File layout:

| region  | offset                     | size                               |
|---------|----------------------------|------------------------------------|
| header  | 0                          | 4096                               |
| markers | 4096                       | capacity x u32, padded to 4096     |
| slots   | 4096 + marker_region_bytes | capacity x slot_bytes              |

Header (bytes 0..HEADER_CHECKED are written once and covered by a CRC-32):

| offset | size | field       | meaning                                            | owner      |
|--------|------|-------------|----------------------------------------------------|------------|
| 0      | 8    | magic       | b"IFABSEG\\0"                                       | creator    |
| 8      | 4    | version     | format version, 1                                  | creator    |
| 12     | 4    | kind        | 1 = input log, 2 = completion log                  | creator    |
| 16     | 8    | segment_id  | increasing, never reused                           | creator    |
| 24     | 4    | shape       | shape id (input) or 0                              | creator    |
| 28     | 4    | lane        | lane edge in tokens (input) or result size class in bytes (completion) | creator |
| 32     | 4    | slot_bytes  | bytes per slot, a multiple of 8                    | creator    |
| 36     | 4    | capacity    | number of slots                                    | creator    |
| 40     | 8    | created_ns  | wall-clock creation time                           | creator    |
| 48     | 64   | name        | model (input) or job id (completion), UTF-8, NUL padded (so a model name is at most 64 bytes: pipeline/store/model_names.py) | creator |
| 112    | 4    | header_crc  | CRC-32 of bytes 0..112                             | creator    |
| 512    | 4    | sealed      | 1 once no more appends will happen                 | writer, recovery |
| 520    | 8    | sealed_ns   | wall-clock time of sealing, 0 while open           | writer, recovery |
| 576    | 8    | entries     | advisory: slots ever made LIVE                     | writer, recovery |
| 640    | 8    | deleted     | advisory: slots made DEAD                          | completion, recovery |

The advisory words sit on their own cache lines, each with one owner.
Recovery never trusts them: it recounts them from the markers.

Marker (u32 per slot): byte 0 is the state (EMPTY = 0, never written; LIVE =
1; DEAD = 2, retired, terminal; for the completion log DEAD means delivered),
byte 1 is the number of times the item was reclaimed (written by dispatch as a
single-byte store), bytes 2-3 are zero.

Slot (u32 words; body_bytes = slot_bytes - 32):

| word | field    | meaning                                                 |
|------|----------|---------------------------------------------------------|
| 0-1  | seq      | u64, item sequence number, never 0                      |
| 2-3  | job      | u64, job number                                         |
| 4    | index    | u32, item index within its job                          |
| 5    | count    | u32, body length: tokens (input) or bytes (completion)  |
| 6    | checksum | u32, see slot_checksums()                               |
| 7    | flags    | u32: input log 0; completion log: status, kind, model, shape (collector/completion/record_format.py) |
| 8..  | body     | tokens (u32) or result bytes, zero padded               |

A slot is written before its marker becomes LIVE; both reach the disk in the
same fdatasync (group commit) before anything is acknowledged. A crash inside
that window can leave a LIVE marker over a torn slot: its checksum fails and
recovery cuts it (it was never acknowledged).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import SegmentError, SegmentFormatError
from pipeline.core.file_names import file_safe, from_file_safe

MAGIC = b"IFABSEG\0"
VERSION = 1
KIND_INPUT = 1
KIND_COMPLETION = 2
KIND_PREFIX = {KIND_INPUT: "in", KIND_COMPLETION: "out"}

PAGE = 4096
HEADER_BYTES = 4096
HEADER_CHECKED = 112
NAME_BYTES = 64
SEALED_OFFSET = 512
SEALED_NS_OFFSET = 520
ENTRIES_OFFSET = 576
DELETED_OFFSET = 640
SLOT_HEADER_BYTES = 32
SLOT_HEADER_WORDS = SLOT_HEADER_BYTES // 4
COUNT_WORD = 5  # the slot header's token count, as a u32 word (seq 0-1, job 2-3, index 4)
CHECKSUM_WORD = 6
CHECKSUM_SEED = 0x5EED_F00D

EMPTY = 0
LIVE = 1
DEAD = 2
STATE_MASK = 0xFF
LIVE_MASK = 0xFFFF00FF  # every bit but the attempts byte
KNOWN_STATES = (EMPTY, LIVE, DEAD)


def known_markers(markers: np.ndarray) -> np.ndarray:
    """True for each marker in a known state: EMPTY, LIVE or DEAD, and zero high bytes."""
    states = markers & STATE_MASK
    return (markers >> 16 == 0) & ((states == EMPTY) | (states == LIVE) | (states == DEAD))


def live_markers(markers: np.ndarray) -> np.ndarray:
    """True for each marker that is LIVE in full: state LIVE and upper bytes zero.

    The attempts byte may hold anything. A marker whose low byte reads LIVE but
    whose upper bytes are not zero is in no known state: never dispatched.
    """
    return (markers & LIVE_MASK) == LIVE


_HEADER = struct.Struct("<8sIIQIIIIQ64s")  # the fields up to HEADER_CHECKED
SUFFIX = ".seg"
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class SegmentKey:
    """What every item of one segment shares."""

    kind: int
    name: str
    shape: int = 0
    lane: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KIND_PREFIX:
            raise SegmentError(f"segment kind {self.kind!r} is not 1 (input) or 2 (completion)")
        if not self.name or len(self.name.encode()) > NAME_BYTES:
            raise SegmentError(f"segment name {self.name!r} must be 1..{NAME_BYTES} UTF-8 bytes")


@dataclass(frozen=True)
class SegmentHeader:
    """The checked part of a header, as read from a file."""

    segment_id: int
    key: SegmentKey
    slot_bytes: int
    capacity: int
    created_ns: int

    @property
    def marker_region_bytes(self) -> int:
        return marker_region_bytes(self.capacity)

    @property
    def slots_offset(self) -> int:
        return HEADER_BYTES + self.marker_region_bytes

    @property
    def file_bytes(self) -> int:
        return self.slots_offset + self.capacity * self.slot_bytes


def marker_region_bytes(capacity: int) -> int:
    return -(-capacity * 4 // PAGE) * PAGE


def slot_bytes_for(body_bytes: int) -> int:
    """Slot size for a body of `body_bytes`, rounded up to a multiple of 8."""
    return SLOT_HEADER_BYTES + -(-body_bytes // 8) * 8


def capacity_for(segment_bytes: int, slot_bytes: int) -> int:
    """The most slots that fit a file of `segment_bytes` (at least one)."""
    capacity = max(1, (segment_bytes - HEADER_BYTES) // (slot_bytes + 4))
    while capacity > 1 and (
        HEADER_BYTES + marker_region_bytes(capacity) + capacity * slot_bytes > segment_bytes
    ):
        capacity -= 1
    return capacity


def segment_file_name(segment_id: int, key: SegmentKey) -> str:
    """`in-000000000042.minilm.s3.l512.seg`: id first, so names sort by id. The name part
    is the key's name made file-safe (pipeline/core/file_names.py): a model's '/' is `%2F`."""
    safe = file_safe(key.name)
    return f"{KIND_PREFIX[key.kind]}-{segment_id:012d}.{safe}.s{key.shape}.l{key.lane}{SUFFIX}"


_FILE_NAME = re.compile(r"(in|out)-(\d{12})\.(.+)\.s(\d+)\.l(\d+)\.seg\Z")


def parse_segment_file_name(name: str) -> tuple[int, int, int, int] | None:
    """(kind, segment id, shape, lane) from a name `segment_file_name` made; None if it is
    not one. The model part is only its file-safe form: compare names, not models."""
    found = _FILE_NAME.match(name)
    if found is None:
        return None
    prefix, segment_id, _, shape, lane = found.groups()
    kind = next(k for k, p in KIND_PREFIX.items() if p == prefix)
    return kind, int(segment_id), int(shape), int(lane)


def segment_file_model(name: str) -> str | None:
    """The model (input) or job id (completion) part of a name `segment_file_name` made, its
    file-safe form decoded (pipeline/core/file_names.py: `%2F` is '/'); None if it is not one. An
    input segment's file name spells its model whole, so salvage can trust it over a damaged
    header field."""
    found = _FILE_NAME.match(name)
    if found is None:
        return None
    try:
        return from_file_safe(found.group(3))
    except UnicodeDecodeError:
        return None


def slot_dtype(slot_bytes: int) -> np.dtype:
    """The slot table as a numpy structured dtype."""
    return np.dtype(
        [
            ("seq", "<u8"),
            ("job", "<u8"),
            ("index", "<u4"),
            ("count", "<u4"),
            ("checksum", "<u4"),
            ("flags", "<u4"),
            ("body", "u1", (slot_bytes - SLOT_HEADER_BYTES,)),
        ]
    )


_weights_cache: dict[int, np.ndarray] = {}


def _checksum_weights(words: int) -> np.ndarray:
    weights = _weights_cache.get(words)
    if weights is None:
        i = np.arange(1, words + 1, dtype=np.uint64)
        weights = (((i * 0x9E3779B1) ^ (i >> 3) * 0x85EBCA6B) | 1).astype(np.uint32)
        weights[CHECKSUM_WORD] = 0
        _weights_cache[words] = weights
    return weights


def slot_checksums(words: np.ndarray) -> np.ndarray:
    """Checksums of slots given as a [n, slot_words] uint32 array.

    A weighted sum of every word but the checksum word, modulo 2**32, plus a
    seed. Every weight is odd, so any single flipped bit changes the sum; a
    slot of zeros does not check. Vectorised: about 0.3 us for a 2 KiB slot.
    """
    weights = _checksum_weights(words.shape[1])
    out = np.einsum("ij,j->i", words, weights, dtype=np.uint32)  # no temporary; wraps mod 2**32
    out += np.uint32(CHECKSUM_SEED)
    return out


def parse_header(raw: bytes, path: Path | str = "?") -> SegmentHeader:
    """Validate and decode a header page; raise SegmentFormatError naming the problem."""
    if len(raw) < HEADER_CHECKED + 4:
        raise SegmentFormatError(
            f"{path}: file is {len(raw)} bytes, shorter than a header", "wrong-size"
        )
    magic, version, kind, seg_id, shape, lane, slot_bytes, capacity, created, name = (
        _HEADER.unpack_from(raw)
    )
    if magic != MAGIC:
        raise SegmentFormatError(f"{path}: bad magic {magic!r}, not a segment file", "bad-magic")
    if version != VERSION:
        newer = "a newer" if version > VERSION else "an unknown"
        raise SegmentFormatError(
            f"{path}: format version {version} is {newer} version; this broker reads {VERSION}",
            "bad-version",
        )
    (crc,) = struct.unpack_from("<I", raw, HEADER_CHECKED)
    if zlib.crc32(raw[:HEADER_CHECKED]) != crc:
        raise SegmentFormatError(f"{path}: header checksum mismatch (header damaged)")
    if kind not in KIND_PREFIX or slot_bytes <= SLOT_HEADER_BYTES or slot_bytes % 8 or capacity < 1:
        raise SegmentFormatError(
            f"{path}: header fields out of range (kind={kind}, slot_bytes={slot_bytes}, "
            f"capacity={capacity})"
        )
    key = SegmentKey(kind, name.rstrip(b"\0").decode("utf-8", "replace"), shape, lane)
    return SegmentHeader(seg_id, key, slot_bytes, capacity, created)


def encode_header(header: SegmentHeader) -> bytes:
    key = header.key
    body = _HEADER.pack(
        MAGIC,
        VERSION,
        key.kind,
        header.segment_id,
        key.shape,
        key.lane,
        header.slot_bytes,
        header.capacity,
        header.created_ns,
        key.name.encode(),
    )
    page = bytearray(HEADER_BYTES)
    page[:HEADER_CHECKED] = body
    struct.pack_into("<I", page, HEADER_CHECKED, zlib.crc32(body))
    return bytes(page)
