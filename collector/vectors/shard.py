"""One vector shard: three append-only files, durable at `flush()`, recovered on open.

| file            | content                                   | size                         |
|-----------------|-------------------------------------------|------------------------------|
| `<id>.payload`  | rows of `dtype` (`<f2` or `<f4`), `dim` each, row-major, no header | `rows * dim * itemsize` |
| `<id>.ids`      | one `<u8` (u64, little-endian) per row    | `rows * 8`                   |
| `<id>.journal`  | checksummed records (`pipeline.store.records`)  | grows by one record a flush  |

Each journal record is `[u32 length][u32 crc32 of payload][payload: JSON]`:

| record  | JSON fields                                              | when                  |
|---------|----------------------------------------------------------|-----------------------|
| header  | `format` (1), `shard`, `dtype` ("float16"/"float32"), `dim` | first, at `create()` |
| append  | `first`, `count`, `payload_crc`, `ids_crc` (crc32 of the bytes appended to each file) | each `flush()` with rows |
| seal    | `sealed` (total rows)                                    | last, at `seal()`     |

`<id>` is the shard id as six decimal digits. The durability rule: `flush()`
writes payload and ids, fdatasyncs both, and only then writes and fdatasyncs
the append record; rows are acknowledged once that record is durable, so
every journalled row has its bytes on disk. On open the journal is replayed:
a torn or corrupt last record is cut, bytes beyond the last journalled row
are truncated, and a journal that claims more rows than the files hold (data
lost after a power loss) raises `VectorShardError`, never serving the shard.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from collector.vectors.vector_errors import (
    VectorInputError,
    VectorSealedError,
    VectorShardBusy,
    VectorShardError,
)
from collector.vectors.vector_rows import DTYPES, IDS_DTYPE, validate_rows
from pipeline.store.durable import fsync_dir
from pipeline.store.records import MAX_RECORD_BYTES, encode_record, read_records
from pipeline.store.segment import disk_error

FORMAT_VERSION = 1
_HEAD = struct.Struct("<II")
DONTNEED = os.POSIX_FADV_DONTNEED


def shard_paths(directory: Path, shard_id: int) -> tuple[Path, Path, Path]:
    """(payload, ids, journal) paths of shard `shard_id` under `directory`."""
    stem = Path(directory) / f"{shard_id:06d}"
    return stem.with_suffix(".payload"), stem.with_suffix(".ids"), stem.with_suffix(".journal")


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset`; a short write (disk filling up) is retried to an error."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "no progress writing", None)
        view = view[written:]
        offset += written


def _write_arrays(fd: int, arrays: list[np.ndarray], row_bytes: int, first_row: int) -> int:
    """Write contiguous arrays back to back from row `first_row`; returns their crc32."""
    crc, offset = 0, first_row * row_bytes
    for array in arrays:
        data = memoryview(array).cast("B")
        crc = zlib.crc32(data, crc)
        _write_all(fd, data, offset)
        offset += len(data)
    return crc


def _has_later_record(data: bytes, start: int) -> bool:
    """Whether a whole, checksummed record starts anywhere after `start` (mid-journal damage)."""
    for pos in range(start + 1, len(data) - _HEAD.size + 1):
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if (
            0 < length <= MAX_RECORD_BYTES
            and end <= len(data)
            and zlib.crc32(data[pos + _HEAD.size : end]) == crc
        ):
            return True
    return False


class Shard:
    """An open shard. Appends buffer in memory; `flush()` makes them durable.

    `rows` counts durable (acknowledged) rows; `append` returns the stable
    `(shard_id, first_row)` an append will have once flushed. One process
    appends at a time: open takes an exclusive `flock` on the journal.
    """

    def __init__(self, directory: Path, shard_id: int, dim: int, dtype: np.dtype) -> None:
        self.directory = Path(directory)
        self.shard_id = shard_id
        self.dim = dim
        self.dtype = dtype
        self.row_bytes = dim * dtype.itemsize
        self.payload_path, self.ids_path, self.journal_path = shard_paths(directory, shard_id)
        self.rows = 0
        self.sealed = False
        self._pending_rows: list[np.ndarray] = []
        self._pending_ids: list[np.ndarray] = []
        self._pending_count = 0
        self._fds: dict[str, int] = {}
        self._journal_bytes = 0
        self.readonly = False
        self.findings: list[tuple[str, str]] = []  # read-only open: (code, what recovery would cut)
        self._appends: list[dict] = []

    # -- opening -----------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, shard_id: int, dim: int, dtype: str) -> Shard:
        """Create an empty shard; fails if any of its files exists (ids are never reused)."""
        if dtype not in DTYPES:
            raise VectorInputError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if not isinstance(dim, int) or dim < 1:
            raise VectorInputError(f"dim {dim!r} must be a positive integer")
        shard = cls(directory, shard_id, dim, DTYPES[dtype])
        header = {"format": FORMAT_VERSION, "shard": shard_id, "dtype": dtype, "dim": dim}
        try:
            for path in (shard.payload_path, shard.ids_path, shard.journal_path):
                if path.exists():
                    raise VectorShardError(f"{path}: shard {shard_id} already exists")
            shard._open_files(os.O_CREAT | os.O_EXCL)
            _write_all(shard._fds["journal"], encode_record(header), 0)
            for fd in shard._fds.values():
                os.fdatasync(fd)
            fsync_dir(shard.directory)
            shard._journal_bytes = os.fstat(shard._fds["journal"]).st_size
        except OSError as exc:
            shard.close()
            raise disk_error(exc, shard.journal_path, "creating a vector shard") from exc
        return shard

    @classmethod
    def open(cls, directory: Path, shard_id: int, readonly: bool = False) -> Shard:
        """Open an existing shard, recovering it: see the module docstring.

        `readonly` (for `check`) changes nothing on disk: what recovery would
        cut is listed in `findings`, and the open fails if a process has the
        shard open for appending.
        """
        journal_path = shard_paths(directory, shard_id)[2]
        if not journal_path.exists():
            raise VectorShardError(f"{journal_path}: no such shard journal")
        records, good = read_records(journal_path)
        header = records[0] if records else None
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
            raise VectorShardError(
                f"{journal_path}: no readable header record (format {FORMAT_VERSION} "
                f"expected, found {header!r}); the shard cannot be served"
            )
        if header.get("dtype") not in DTYPES or header.get("shard") != shard_id:
            raise VectorShardError(
                f"{journal_path}: header {header!r} does not fit shard {shard_id}"
            )
        shard = cls(directory, shard_id, int(header["dim"]), DTYPES[header["dtype"]])
        shard.readonly = readonly
        try:
            shard._open_files(0)
            shard._recover(records[1:], good)
        except OSError as exc:
            shard.close()
            raise disk_error(exc, journal_path, "opening a vector shard") from exc
        except BaseException:
            shard.close()
            raise
        return shard

    def _open_files(self, create_flags: int) -> None:
        for name, path in (
            ("payload", self.payload_path),
            ("ids", self.ids_path),
            ("journal", self.journal_path),
        ):
            mode = os.O_RDONLY if self.readonly else os.O_RDWR | create_flags
            self._fds[name] = os.open(path, mode, 0o600)
        lock = fcntl.LOCK_SH if self.readonly else fcntl.LOCK_EX
        try:
            fcntl.flock(self._fds["journal"], lock | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise VectorShardBusy(
                f"{self.journal_path}: another process has this shard open for appending"
            ) from exc

    def _recover(self, appends: list[Any], good: int) -> None:
        journal = self._fds["journal"]
        size = os.fstat(journal).st_size
        if size != good:
            data = os.pread(journal, size - good, good)
            if _has_later_record(data, -1):
                raise VectorShardError(
                    f"{self.journal_path}: damaged record at byte {good} with whole records "
                    f"after it; this is not a torn tail, the shard cannot be served"
                )
            if self.readonly:
                self.findings.append(
                    ("vector-torn-journal", f"{size - good} byte(s) of a torn last record")
                )
            else:
                os.ftruncate(journal, good)
                os.fdatasync(journal)
        total = 0
        last = None
        for index, record in enumerate(appends):
            if self.sealed:
                raise VectorShardError(f"{self.journal_path}: record {index + 1} after the seal")
            if "sealed" in record:
                if record["sealed"] != total:
                    raise VectorShardError(
                        f"{self.journal_path}: seal says {record['sealed']} rows, appends sum to {total}"
                    )
                self.sealed = True
                continue
            if record.get("first") != total:
                raise VectorShardError(
                    f"{self.journal_path}: append record {index + 1} starts at row "
                    f"{record.get('first')}, expected {total}"
                )
            total += int(record["count"])
            last = record
            self._appends.append(record)
        self._check_sizes(total)
        if last is not None:
            self._check_last(last)
        self.rows = total
        self._journal_bytes = good

    def _check_sizes(self, total: int) -> None:
        for name, path, row_bytes in (
            ("payload", self.payload_path, self.row_bytes),
            ("ids", self.ids_path, IDS_DTYPE.itemsize),
        ):
            fd = self._fds[name]
            size = os.fstat(fd).st_size
            want = total * row_bytes
            if size < want:
                raise VectorShardError(
                    f"{path}: holds {size} bytes ({size // row_bytes} whole rows) but the "
                    f"journal {self.journal_path.name} acknowledges {total} rows ({want} bytes); "
                    "acknowledged data was lost (power loss or truncation), the shard is not served"
                )
            if size > want:
                if self.sealed:
                    raise VectorShardError(
                        f"{path}: sealed shard has {size} bytes, journal says {want}"
                    )
                if self.readonly:
                    self.findings.append(
                        (
                            "vector-unacknowledged-rows",
                            f"{path.name} holds {size - want} byte(s) past the {total} "
                            "journalled rows (a crash mid-flush); never served",
                        )
                    )
                    continue
                os.ftruncate(fd, want)  # unacknowledged rows from a crash mid-flush
                os.fdatasync(fd)

    def _check_last(self, record: dict) -> None:
        count = int(record["count"])
        first = int(record["first"])
        payload = os.pread(self._fds["payload"], count * self.row_bytes, first * self.row_bytes)
        ids = os.pread(self._fds["ids"], count * IDS_DTYPE.itemsize, first * IDS_DTYPE.itemsize)
        for path, data, crc in (
            (self.payload_path, payload, record["payload_crc"]),
            (self.ids_path, ids, record["ids_crc"]),
        ):
            if zlib.crc32(data) != crc:
                raise VectorShardError(
                    f"{path}: rows {first}..{first + count - 1} fail the journal checksum "
                    f"({zlib.crc32(data):#010x} != {crc:#010x}); the shard is not served"
                )

    def verify(self) -> list[str]:
        """Re-checksum every journalled batch (for `check`); returns what fails, one line each."""
        problems = []
        for record in self._appends:
            first, count = int(record["first"]), int(record["count"])
            for name, path, row_bytes, crc in (
                ("payload", self.payload_path, self.row_bytes, record["payload_crc"]),
                ("ids", self.ids_path, IDS_DTYPE.itemsize, record["ids_crc"]),
            ):
                value, offset, left = 0, first * row_bytes, count * row_bytes
                while left:
                    data = os.pread(self._fds[name], min(left, 64 << 20), offset)
                    if not data:
                        break
                    value = zlib.crc32(data, value)
                    offset += len(data)
                    left -= len(data)
                if value != crc:
                    problems.append(
                        f"{path.name}: rows {first}..{first + count - 1} fail the journal "
                        f"checksum ({value:#010x} != {crc:#010x})"
                    )
        return problems

    # -- appending ---------------------------------------------------------------

    @property
    def pending_rows(self) -> int:
        """Rows appended but not yet durable."""
        return self._pending_count

    def append(
        self, ids: np.ndarray, rows: np.ndarray, copy: bool = True, checked: bool = False
    ) -> tuple[int, int]:
        """Queue rows (all or nothing); returns `(shard_id, first_row)`, durable after `flush()`.

        With `copy=False` rows already of the shard's dtype are queued as they
        are: the caller must not change them until the flush. `checked` says
        `validate` already passed them (the store validates a batch once).
        """
        if self.sealed:
            raise VectorSealedError(f"{self.journal_path}: shard {self.shard_id} is sealed")
        ids_arr, rows_arr = (ids, rows) if checked else self.validate(ids, rows, copy)
        first = self.rows + self._pending_count
        self._pending_ids.append(ids_arr)
        self._pending_rows.append(rows_arr)
        self._pending_count += len(rows_arr)
        return self.shard_id, first

    def validate(
        self, ids: np.ndarray, rows: np.ndarray, copy: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """`ids` and `rows` as this shard stores them, or a `VectorInputError` (`validate_rows`)."""
        return validate_rows(ids, rows, self.dim, self.dtype, self.shard_id, copy)

    def flush(self) -> tuple[int, int]:
        """Make queued rows durable; returns `(first_row, count)` that became durable.

        Payload and ids are written and fdatasynced before the journal record.
        On an OSError (ENOSPC: `DiskFullError`, retryable) the files are cut
        back to the durable rows and the queue stays for the next try.
        """
        if not self._pending_count:
            return self.rows, 0
        first, count = self.rows, self._pending_count
        journal_end = self._journal_bytes
        try:  # the queued arrays go to the files as they are: no joined copy
            payload_crc = _write_arrays(
                self._fds["payload"], self._pending_rows, self.row_bytes, first
            )
            ids_crc = _write_arrays(self._fds["ids"], self._pending_ids, IDS_DTYPE.itemsize, first)
            os.fdatasync(self._fds["payload"])
            os.fdatasync(self._fds["ids"])
            record = {
                "first": first,
                "count": count,
                "payload_crc": payload_crc,
                "ids_crc": ids_crc,
            }
            _write_all(self._fds["journal"], encode_record(record), journal_end)
            os.fdatasync(self._fds["journal"])
        except OSError as exc:
            self._cut_back(journal_end)
            raise disk_error(exc, self.payload_path, f"flushing {count} rows") from exc
        for name, row_bytes in (("payload", self.row_bytes), ("ids", IDS_DTYPE.itemsize)):
            # Written and synced: drop the pages. Fresh page-cache pages are what appends
            # pay for on VMs (bench/vectors.py); a search maps the file and reads it back.
            os.posix_fadvise(self._fds[name], first * row_bytes, count * row_bytes, DONTNEED)
        self._appends.append(record)
        self.rows += count
        self._journal_bytes = os.fstat(self._fds["journal"]).st_size
        self._pending_rows.clear()
        self._pending_ids.clear()
        self._pending_count = 0
        return first, count

    def _cut_back(self, journal_end: int) -> None:
        """Best effort: drop unacknowledged bytes (recovery would cut them anyway)."""
        try:
            os.ftruncate(self._fds["journal"], journal_end)
            os.ftruncate(self._fds["payload"], self.rows * self.row_bytes)
            os.ftruncate(self._fds["ids"], self.rows * IDS_DTYPE.itemsize)
        except OSError:
            pass

    def seal(self) -> None:
        """Flush, then journal the seal: the shard is immutable from here on."""
        if self.sealed:
            return
        self.flush()
        try:
            _write_all(
                self._fds["journal"], encode_record({"sealed": self.rows}), self._journal_bytes
            )
            os.fdatasync(self._fds["journal"])
        except OSError as exc:
            self._cut_back(self._journal_bytes)
            raise disk_error(exc, self.journal_path, "sealing a vector shard") from exc
        self.sealed = True

    # -- reading -----------------------------------------------------------------

    def read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """`(ids, rows)` of durable rows `first .. first+count-1`, memory-mapped read-only."""
        if first < 0 or count < 0 or first + count > self.rows:
            raise VectorInputError(
                f"rows {first}..{first + count - 1} are outside shard {self.shard_id} "
                f"(0..{self.rows - 1} durable)"
            )
        if count == 0:
            return np.empty(0, IDS_DTYPE), np.empty((0, self.dim), self.dtype)
        rows = np.memmap(
            self.payload_path,
            self.dtype,
            "r",
            offset=first * self.row_bytes,
            shape=(count, self.dim),
        )
        ids = np.memmap(
            self.ids_path, IDS_DTYPE, "r", offset=first * IDS_DTYPE.itemsize, shape=(count,)
        )
        return ids, rows

    def close(self) -> None:
        """Close the files; queued (unflushed) rows are dropped, as after a crash."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
