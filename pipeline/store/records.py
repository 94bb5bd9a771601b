"""Append-only files of checksummed JSON records: the shape table and job journals.

Each record is `[u32 length][u32 crc32 of the payload][payload: orjson]`,
little-endian. A reader stops at the first record that is short or fails its
checksum: that is a torn tail from a crash (the record was never made
durable, so nothing that depended on it was acknowledged). `RecordLog`
cuts such a tail before it appends again.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from pipeline.store.durable import fsync_dir
from pipeline.store.segment import disk_error

_HEAD = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 30


def read_records(path: Path) -> tuple[list[Any], int]:
    """All whole records of `path`, and the byte length they cover."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    records, pos = [], 0
    for record, end in iter_records(data):
        records.append(record)
        pos = end
    return records, pos


def iter_records(data: bytes) -> Iterator[tuple[Any, int]]:
    """The whole records at the start of `data`, each with the offset just past it; stops at
    the first short or damaged record (a torn tail)."""
    pos = 0
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        start, end = pos + _HEAD.size, pos + _HEAD.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            return
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            return
        try:
            record = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        yield record, end
        pos = end


def encode_record(record: Any) -> bytes:
    payload = orjson.dumps(record)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


class RecordLog:
    """An append handle: cuts a torn tail on open; `append` buffers, `sync` makes durable.

    Every open makes the log's name durable at once (its directory fsynced), whether this
    open made the file or a process killed before its own directory sync did: a record
    fdatasynced into a file whose name a power cut takes is lost with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records, good = read_records(path)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fsync_dir(path.parent)
            if os.fstat(self._fd).st_size != good:
                os.ftruncate(self._fd, good)
            os.lseek(self._fd, good, os.SEEK_SET)
        except OSError as exc:
            raise disk_error(exc, path, "opening a record log") from exc
        self._pending: list[bytes] = []

    @property
    def pending(self) -> list[Any]:
        """Records appended but not yet made durable by `sync()`."""
        return self._pending

    def append(self, record: Any) -> None:
        """Queue a record; durable (and in `records`) only after `sync()`."""
        self._pending.append(record)

    def sync(self) -> None:
        """Write queued records and fdatasync them: one write and one sync for the batch.

        On failure (a full disk) the file is cut back to where it was, so a
        partial batch never sits in front of later records; the queued
        records stay queued for the next try.
        """
        if not self._pending:
            return
        data = b"".join(encode_record(r) for r in self._pending)
        start = os.lseek(self._fd, 0, os.SEEK_CUR)
        try:
            view = memoryview(data)
            while view:  # a write may take only part of the bytes (a filling disk)
                view = view[os.write(self._fd, view) :]
            os.fdatasync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)
            finally:
                os.lseek(self._fd, start, os.SEEK_SET)
            raise disk_error(exc, self.path, "appending records") from exc
        self.records.extend(self._pending)
        self._pending.clear()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
