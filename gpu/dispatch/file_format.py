"""The dispatch file's format: header, entries, and reading them back (gpu/dispatch/file.py writes it).

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
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import FabricError

LEASE_DTYPE = np.dtype([("segment", "<u8"), ("slot", "<u4"), ("seq", "<u8")])
SLOT_DTYPE = np.dtype("<u4")
MAGIC = b"IFDISP1\0"
VERSION = 1
HEADER_BYTES = 40
KIND_LEASE = 1
KIND_DROP = 2
MAX_SESSION_CHARS = 64
MAX_ENTRY_BYTES = 1 << 30

_HEADER = struct.Struct("<8sIIQQ")  # the fields covered by header_crc
ENTRY = struct.Struct("<II")  # length, crc
LEASE_HEAD = struct.Struct("<BQIB")  # kind, batch_id, n, session_len
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
    return b"".join((ENTRY.pack(len(head) + len(tail), crc), head, tail))


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
        head = LEASE_HEAD.pack(KIND_LEASE, batch_id, len(items), len(name)) + name
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
    while pos + ENTRY.size < len(data):
        length, crc = ENTRY.unpack_from(data, pos)
        body, end = pos + ENTRY.size, pos + ENTRY.size + length
        if not 0 < length <= MAX_ENTRY_BYTES or end > len(data):
            break
        if zlib.crc32(view[body:end]) != crc:
            break
        kind = data[body]
        if kind == KIND_LEASE and length >= LEASE_HEAD.size:
            _, batch_id, n, name_len = LEASE_HEAD.unpack_from(data, body)
            at = body + LEASE_HEAD.size + name_len
            if at + n * LEASE_DTYPE.itemsize != end:
                break
            try:
                sessions[batch_id] = data[body + LEASE_HEAD.size : at].decode("ascii")
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
