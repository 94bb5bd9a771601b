"""The reuse index: stored results of deterministic requests, found again by their key.

Its files are under `<data_dir>/reuse/`, apart from any job's, with their own
retention and size cap (`[reuse]` in the config, docs/completion.md "Result reuse"):

| file              | what |
|-------------------|------|
| `table.bin`       | key -> (data file, offset, length): pipeline/store/reuse_table.py |
| `data-<n>.log`    | result records, appended; a new file past `FILE_BYTES`, after an eighth of the retention (a day at most), and at each writer's start |
| `data-<n>.evicted`| a data file whose entries left the table; removed `GRACE_S` after |
| `lock`            | flocked by the one writer while it is open |

A record is a 48-byte header (`RECORD`) then the payload, padded to 8 bytes;
`check` is a CRC-32 of the header after it and the payload. The completion
stage is the one writer (`ReuseWriter`): it appends the results of reusing
jobs, fdatasyncs the data file and only then puts their keys in the table, so
a key never points at a record that a crash or power cut can lose. The front
reads the table (`ReuseReader.lookup`); completion reads the records back for
the lines the front found (`read_results`), checking key and CRC: a record
gone or damaged is `None` (the line gets an error result, never a wrong one).

Evicting (`ReuseWriter.evict`) drops whole data files, oldest first: those
written to last more than `retention_s` ago, then more while the data files
hold more than `max_bytes`. The table is rebuilt without their entries, then
each file is renamed `.evicted` and removed `GRACE_S` later, so a line the
front found just before still reads its result.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.ragged import Ragged, offsets_of
from pipeline.store.durable import fsync_dir
from pipeline.store.reuse_table import (
    SLOT,
    TABLE_FILE,
    ReuseTable,
    TableError,
    capacity_for,
    rebuild,
)

REUSE_DIR = "reuse"
FILE_BYTES = 256 << 20  # a data file is closed for appends past this
GRACE_S = 900.0  # an evicted data file stays readable this long (a found line's result)
RECORD_MAGIC = 0x31455552  # b"RUE1"
RECORD = np.dtype(
    [
        ("magic", "<u4"),
        ("check", "<u4"),
        ("k0", "<u8"),
        ("k1", "<u8"),
        ("created_ns", "<u8"),
        ("payload_bytes", "<u4"),
        ("prompt_tokens", "<u4"),
        ("kind", "u1"),
        ("status", "u1"),
        ("pad", "V6"),
    ]
)
DATA_NAME = re.compile(r"data-(\d{8})\.(log|evicted)\Z")


def reuse_dir(data_root: Path) -> Path:
    return Path(data_root) / REUSE_DIR


def data_path(root: Path, file: int, evicted: bool = False) -> Path:
    return root / f"data-{file:08d}.{'evicted' if evicted else 'log'}"


def record_check(header: bytes, payload: bytes) -> int:
    """The CRC-32 of a record: its header after the check word, then its payload."""
    return zlib.crc32(payload, zlib.crc32(header[8:]))


@dataclass(frozen=True, slots=True)
class StoredResult:
    kind: int
    status: int
    prompt_tokens: int
    payload: bytes


class ReuseReader:
    """The table, mapped read-only; mapped again when the writer replaced the file."""

    def __init__(self, data_root: Path) -> None:
        self.root = reuse_dir(data_root)
        self.table: ReuseTable | None = None

    def _current(self) -> ReuseTable | None:
        path = self.root / TABLE_FILE
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if self.table is None or self.table.inode != (st.st_dev, st.st_ino):
            if self.table is not None:
                self.table.close()
            try:
                self.table = ReuseTable(path, writable=False)
            except (TableError, OSError):
                self.table = None
        return self.table

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """(file, offset, length) of each key's record ([n, 3] u8 rows); file 0: not found."""
        out = np.zeros((len(keys), 3), np.uint64)
        table = self._current()
        if table is None or not len(keys):
            return out
        at = table.find(keys)
        hit = np.flatnonzero(at >= 0)
        found = table.slots[at[hit]]
        out[hit, 0], out[hit, 1], out[hit, 2] = found["file"], found["offset"], found["length"]
        return out

    def close(self) -> None:
        if self.table is not None:
            self.table.close()
            self.table = None


def read_results(data_root: Path, keys: np.ndarray, where: np.ndarray) -> list[StoredResult | None]:
    """The records at `where` ([n, 3]: file, offset, length), each checked against its key;
    None for one that is gone, torn or not that key's. One read per data file (the span of
    its records asked for), headers parsed at once; a CRC per record."""
    root = reuse_dir(data_root)
    out: list[StoredResult | None] = [None] * len(keys)
    files, offsets, lengths = (where[:, i].astype(np.int64) for i in range(3))
    for file in np.unique(files).tolist():
        mine = np.flatnonzero((files == file) & (lengths >= RECORD.itemsize))
        if not len(mine):
            continue
        start = int(offsets[mine].min())
        span = _read_span(
            root, int(file), start, int((offsets[mine] + lengths[mine]).max()) - start
        )
        if span is None:
            continue
        whole = offsets[mine] + lengths[mine] - start <= len(span)
        mine = mine[whole]
        at = offsets[mine] - start
        raw = np.frombuffer(span, np.uint8)
        heads = raw[at[:, None] + np.arange(RECORD.itemsize)].copy().view(RECORD).reshape(-1)
        sizes = heads["payload_bytes"].astype(np.int64)
        good = (
            (heads["magic"] == RECORD_MAGIC)
            & (heads["k0"] == keys[mine, 0])
            & (heads["k1"] == keys[mine, 1])
            & (RECORD.itemsize + sizes <= lengths[mine])
        )
        for j in np.flatnonzero(good).tolist():
            a, size = int(at[j]), int(sizes[j])
            payload = span[a + RECORD.itemsize : a + RECORD.itemsize + size]
            head = span[a : a + RECORD.itemsize]
            if record_check(head, payload) == int(heads["check"][j]):
                h = heads[j]
                out[int(mine[j])] = StoredResult(
                    int(h["kind"]), int(h["status"]), int(h["prompt_tokens"]), payload
                )
    return out


def _read_span(root: Path, file: int, start: int, size: int) -> bytes | None:
    for evicted in (False, True):
        try:
            with open(data_path(root, file, evicted), "rb") as f:
                f.seek(start)
                return f.read(size)
        except FileNotFoundError:
            continue
    return None


def data_files(root: Path) -> list[tuple[int, bool, Path]]:
    """(number, evicted, path) of every data file, by number."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = DATA_NAME.match(name)
        if m:
            found.append((int(m.group(1)), m.group(2) == "evicted", root / name))
    return sorted(found)


class ReuseWriter:
    """The one writer (the completion stage): appends results, then indexes them at `flush`."""

    def __init__(self, data_root: Path, retention_s: float, max_bytes: int) -> None:
        self.root = reuse_dir(data_root)
        self.root.mkdir(parents=True, exist_ok=True)
        # one writer at a time (a shared index: `run.py batch --reuse`); BlockingIOError if not
        self.lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.lock_fd)
            raise
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        path = self.root / TABLE_FILE
        if not path.exists():
            ReuseTable.create(path, capacity_for(0))
        try:
            self.table = ReuseTable(path, writable=True)
        except TableError:  # a damaged table holds nothing we can trust: start it again
            path.rename(path.with_name(f"{TABLE_FILE}.damaged"))
            ReuseTable.create(path, capacity_for(0))
            self.table = ReuseTable(path, writable=True)
        numbers = [n for n, _, _ in data_files(self.root)]
        self.file = max(numbers, default=0) + 1  # a new file per writer life: no torn tail
        self.fd = -1
        self.size = 0
        self.roll_at_ns = 0
        self.pending: list[np.ndarray] = []  # SLOT rows appended, not yet synced and indexed
        self.added = 0  # entries indexed by this writer (metrics)

    def append(
        self,
        keys: np.ndarray,
        kinds: np.ndarray,
        statuses: np.ndarray,
        prompt_tokens: np.ndarray,
        rows: Ragged,
        now_ns: int | None = None,
    ) -> None:
        """Append one record per key (indexed at the next `flush`). OSError: nothing indexed."""
        n = len(keys)
        if not n:
            return
        now_ns = time.time_ns() if now_ns is None else now_ns
        if self.fd < 0 or self.size > FILE_BYTES or now_ns > self.roll_at_ns:
            self._roll(now_ns)
        sizes = np.diff(rows.offsets).astype(np.int64)
        lengths = (RECORD.itemsize + sizes + 7) // 8 * 8
        starts = self.size + offsets_of(lengths)[:-1]
        heads = np.zeros(n, RECORD)
        heads["magic"] = RECORD_MAGIC
        heads["k0"], heads["k1"] = keys[:, 0], keys[:, 1]
        heads["created_ns"] = now_ns
        heads["payload_bytes"] = sizes
        heads["prompt_tokens"] = prompt_tokens
        heads["kind"], heads["status"] = kinds, statuses
        values = np.ascontiguousarray(rows.values).view(np.uint8)
        parts = []
        for i in range(n):
            head = heads[i : i + 1].tobytes()
            payload = values[rows.offsets[i] : rows.offsets[i + 1]].tobytes()
            check = record_check(head, payload).to_bytes(4, "little")
            pad = bytes(int(lengths[i]) - RECORD.itemsize - len(payload))
            parts.append(head[:4] + check + head[8:] + payload + pad)
        data = b"".join(parts)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        slots = np.zeros(n, SLOT)
        slots["k0"], slots["k1"] = keys[:, 0], keys[:, 1]
        slots["file"], slots["offset"], slots["length"] = self.file, starts, lengths
        self.size += len(data)
        self.pending.append(slots)

    def _roll(self, now_ns: int) -> None:
        # a file takes appends for at most an eighth of the retention (a day at most), so that
        # retention, which drops whole files, drops entries at most that much past their time
        self.roll_at_ns = now_ns + int(min(self.retention_s / 8, 86400.0) * 1e9)
        if self.fd >= 0:
            os.fdatasync(self.fd)
            os.close(self.fd)
            self.file += 1
        self.fd = os.open(
            data_path(self.root, self.file), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        self.size = os.fstat(self.fd).st_size
        fsync_dir(self.root)

    def flush(self) -> int:
        """Sync what was appended, then index it; returns the entries added."""
        if not self.pending:
            return 0
        os.fdatasync(self.fd)
        slots = np.concatenate(self.pending)
        self.pending = []
        if self.table.needs_room(len(slots)):
            self._rebuild(self.table.entries(), capacity_for(self.table.count + len(slots)) * 2)
        added = self.table.insert(slots)
        self.added += added
        return added

    def _rebuild(self, keep: np.ndarray, capacity: int) -> None:
        path = self.table.path
        self.table.close()
        rebuild(path, keep, capacity)
        self.table = ReuseTable(path, writable=True)

    def evict(self, now_wall_s: float | None = None) -> list[int]:
        """Drop the data files past retention, then the oldest while over `max_bytes`; remove
        evicted files past GRACE_S. Returns the numbers of the files evicted now."""
        now_wall_s = time.time() if now_wall_s is None else now_wall_s
        files = data_files(self.root)
        live = [(n, p, p.stat()) for n, evicted, p in files if not evicted]
        total = sum(st.st_size for _, _, st in live)
        drop = []
        for n, _, st in live:
            old = st.st_mtime < now_wall_s - self.retention_s
            if old or total > self.max_bytes:
                drop.append(n)
                total -= st.st_size
        if drop:
            self.flush()
            if self.file in drop:  # the open file goes too: later appends start a new one
                os.close(self.fd)
                self.fd = -1
                self.file += 1
            entries = self.table.entries()
            keep = entries[~np.isin(entries["file"], drop)]
            self._rebuild(keep, self.table.capacity)
            for n in drop:
                gone = data_path(self.root, n, evicted=True)
                os.replace(data_path(self.root, n), gone)
                os.utime(gone, (now_wall_s, now_wall_s))
            fsync_dir(self.root)
        for _, evicted, p in files:
            if evicted and p.stat().st_mtime < now_wall_s - GRACE_S:
                p.unlink(missing_ok=True)
        return drop

    @property
    def entries(self) -> int:
        return self.table.count

    def data_bytes(self) -> int:
        return sum(p.stat().st_size for _, evicted, p in data_files(self.root) if not evicted)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.table.sync()
            self.table.close()
            os.close(self.lock_fd)  # the lock goes with it
