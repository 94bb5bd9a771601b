"""The reuse index's table: request key -> where its stored result lies, in one mapped file.

`<data_dir>/reuse/table.bin` is an open-addressing hash table with linear
probing: a 64-byte header, then `capacity` (a power of two) slots of 32 bytes:

| field    | type   | meaning                                                        |
|----------|--------|----------------------------------------------------------------|
| `k0, k1` | 2 x u8 | the request key (a 16-byte digest: ingest/reuse_keys.py)       |
| `file`   | u4     | the data file holding the result (`data-<file>.log`); 0: empty |
| `offset` | u4     | where its record starts in that file                           |
| `length` | u4     | the record's bytes (header, payload, padding)                  |
| `check`  | u4     | a weighted sum of the seven words before it (odd weights) + a seed |

A slot is written once, whole, into an empty slot, and never changed in
place: evicting rebuilds the table without the evicted entries into a new file
renamed over the old one (`rebuild`), so no probe chain is ever broken and
there are no tombstones. A reader (the front) maps the file read-only and maps
it again when its inode changed. A slot whose check fails (torn by a crash or
damaged on disk, or half written while a reader looked) is a miss for lookups
and a finding for `run.py check`; a miss only means the request runs again.

Memory is the mapping, not Python objects: 32 bytes per slot, at most half of
them used (`MAX_LOAD`), so 10M entries are a 1 GiB file of which a lookup
touches one page per key. Lookups and inserts are vectorised over a whole
chunk of keys: one numpy pass per probe step, not a Python loop per key.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

from pipeline.core.errors import FabricError
from pipeline.store.durable import fsync_dir

TABLE_FILE = "table.bin"
MAGIC = b"FABRIX01"
HEADER_BYTES = 64
MIN_CAPACITY = 1 << 12
MAX_LOAD = 0.5  # entries per slot before the table doubles
SLOT = np.dtype(
    [
        ("k0", "<u8"),
        ("k1", "<u8"),
        ("file", "<u4"),
        ("offset", "<u4"),
        ("length", "<u4"),
        ("check", "<u4"),
    ]
)
CHECK_SEED = np.uint32(0x5EED_1D55)
_WEIGHTS = (np.arange(1, 8, dtype=np.uint64) * 0x9E3779B1 | 1).astype(np.uint32)


def slot_checks(slots: np.ndarray) -> np.ndarray:
    """The check word each slot should hold (vectorised over a slot array)."""
    words = np.ascontiguousarray(slots).view(np.uint32).reshape(-1, 8)[:, :7]
    out = np.einsum("ij,j->i", words, _WEIGHTS, dtype=np.uint32)
    out += CHECK_SEED
    return out


class TableError(FabricError):
    """The table file is not a reuse table (bad magic or size)."""


class ReuseTable:
    """One mapping of `table.bin`. `writable`: the one writer (completion) may insert."""

    def __init__(self, path: Path, writable: bool) -> None:
        self.path = Path(path)
        self.writable = writable
        fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.inode = (st.st_dev, st.st_ino)
            if st.st_size < HEADER_BYTES + MIN_CAPACITY * SLOT.itemsize:
                raise TableError(f"{self.path}: {st.st_size} bytes is too small for a reuse table")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self.map = mmap.mmap(fd, st.st_size, access=access)
        finally:
            os.close(fd)
        header = bytes(self.map[:HEADER_BYTES])
        capacity = int.from_bytes(header[8:16], "little")
        if header[:8] != MAGIC or capacity < MIN_CAPACITY or capacity & (capacity - 1):
            self.map.close()
            raise TableError(f"{self.path}: not a reuse table (bad magic or capacity)")
        if st.st_size != HEADER_BYTES + capacity * SLOT.itemsize:
            self.map.close()
            raise TableError(
                f"{self.path}: {st.st_size} bytes, expected "
                f"{HEADER_BYTES + capacity * SLOT.itemsize} for {capacity} slots"
            )
        self.capacity = capacity
        self.slots = np.frombuffer(self.map, SLOT, capacity, HEADER_BYTES)
        self.count = int(np.count_nonzero(self.slots["file"])) if writable else 0

    @classmethod
    def create(cls, path: Path, capacity: int) -> None:
        """Write an empty table of `capacity` slots at `path` (atomically, durably)."""
        capacity = max(MIN_CAPACITY, 1 << max(0, int(capacity) - 1).bit_length())
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + capacity.to_bytes(8, "little") + bytes(HEADER_BYTES - 16))
            f.truncate(HEADER_BYTES + capacity * SLOT.itemsize)  # sparse: zeros are empty slots
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def close(self) -> None:
        self.slots = np.empty(0, SLOT)
        with contextlib.suppress(BufferError):  # a caller holds a view: it goes with that
            self.map.close()

    def sync(self) -> None:
        """msync the mapping (its dirty pages only)."""
        self.map.flush()

    # ---- reading ------------------------------------------------------------------------
    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key ([n, 2] u8), -1 where it is absent or its slot fails its check."""
        n = len(keys)
        at = np.full(n, -1, np.int64)
        if not n:
            return at
        mask = np.uint64(self.capacity - 1)
        pos = (keys[:, 0] & mask).astype(np.int64)
        pending = np.arange(n)
        for _ in range(self.capacity):
            if not len(pending):
                break
            seen = self.slots[pos[pending]]
            empty = seen["file"] == 0
            match = ~empty & (seen["k0"] == keys[pending, 0]) & (seen["k1"] == keys[pending, 1])
            at[pending[match]] = pos[pending[match]]
            pending = pending[~match & ~empty]
            pos[pending] = (pos[pending] + 1) & int(mask)
        if (at >= 0).any():
            hit = np.flatnonzero(at >= 0)
            found = self.slots[at[hit]]
            bad = slot_checks(found) != found["check"]
            at[hit[bad]] = -1
        return at

    def entries(self) -> np.ndarray:
        """A copy of every used slot."""
        return self.slots[self.slots["file"] != 0].copy()

    # ---- writing (the one writer) ---------------------------------------------------------
    def insert(self, entries: np.ndarray) -> int:
        """Put `entries` (SLOT rows, check filled here) into empty slots; keys already present
        are left as they are. Returns how many were added. The caller keeps the load below
        MAX_LOAD (`needs_room`)."""
        entries = entries.copy()
        entries["check"] = slot_checks(entries)
        keys = np.stack([entries["k0"], entries["k1"]], axis=1)
        present = self.find(keys) >= 0
        order = np.flatnonzero(~present)
        if len(order):  # a key twice in one call: the first one counts
            _, first = np.unique(keys[order], axis=0, return_index=True)
            order = np.sort(order[first])
        mask = self.capacity - 1
        pos = (entries["k0"][order] & np.uint64(mask)).astype(np.int64)
        pending = np.arange(len(order))
        added = 0
        for _ in range(self.capacity):
            if not len(pending):
                break
            free = self.slots["file"][pos[pending]] == 0
            # of the keys that want one free slot this round, the first takes it
            want = pending[free]
            _, first = np.unique(pos[want], return_index=True)
            winners = want[first]
            self.slots[pos[winners]] = entries[order[winners]]
            added += len(winners)
            taken = np.zeros(len(order), bool)
            taken[winners] = True
            pending = pending[~taken[pending]]
            pos[pending] = (pos[pending] + 1) & mask
        self.count += added
        return added

    def needs_room(self, more: int) -> bool:
        return self.count + more > self.capacity * MAX_LOAD


def rebuild(path: Path, keep: np.ndarray, capacity: int) -> None:
    """Replace the table at `path` with one of `capacity` slots holding `keep` (SLOT rows)."""
    tmp = path.with_name(f"{path.name}.new")
    ReuseTable.create(tmp, capacity)
    table = ReuseTable(tmp, writable=True)
    try:
        table.insert(keep)
        table.sync()
    finally:
        table.close()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def capacity_for(entries: int) -> int:
    """The slots a table needs to hold `entries` below MAX_LOAD (a power of two)."""
    need = max(MIN_CAPACITY, int(entries / MAX_LOAD) + 1)
    return 1 << (need - 1).bit_length()
