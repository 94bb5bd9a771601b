"""The output files that make delivery exactly-once: each key written at most once, then synced.

`ResultFile` appends lines to one output file at most once per key
(collector/delivery/lines.py `line_key`: the line's custom_id, or its id when
it has none), and `sync()` makes them durable: the client acknowledges a page
to the broker only after both of its files are synced (invariant 12), and a
re-run after a crash rewrites nothing it already has (invariant 5).

In memory a file keeps each key as its bare custom_id, or `("id", id)` for a
line without one (a tuple never equals a custom_id): the client hands a page
of templated lines over as its custom_ids (`write_custom_ids`), with no
`custom_id:` string made per line.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from collector.delivery.lines import split_lines
from pipeline.core.errors import FabricError
from pipeline.store.durable import fsync_dir

NEWLINE = ord("\n")
CUSTOM_ID_KEY, ID_KEY = "custom_id:", "id:"  # lines.py `line_key`
Held = str | tuple[str, str]  # a key as the file's set holds it (`held`)


def held(key: str) -> Held:
    """A `line_key` as the set holds it: the bare custom_id, or ("id", id)."""
    if key.startswith(CUSTOM_ID_KEY):
        return key[len(CUSTOM_ID_KEY) :]
    if key.startswith(ID_KEY):
        return ("id", key[len(ID_KEY) :])
    raise ValueError(f"{key!r} is not a line key (custom_id:C or id:I, from line_key)")


class ResultFileError(FabricError):
    """An output file cannot be used: not a result file, in use, or unreadable."""


class ResultFile:
    """One JSONL output file that holds each key at most once, across crashes and re-runs.

    Contract: `open` cuts a torn last line (bytes after the last newline, from
    a writer killed mid-write) and loads the key of every line already there;
    `write` appends only lines whose key is new (also within one call), with
    no buffering of its own; `sync` returns only once everything written is on
    disk, and is the only point after which a page may be acknowledged. A
    failed write or sync leaves the file unusable until it is opened again
    (which cuts what a failed write tore). One process at a time holds a file
    (an exclusive lock), so two clients never append to one path.
    """

    def __init__(self, path: Path, fd: int, keys: set[Held], cut_bytes: int) -> None:
        """Use `ResultFile.open`."""
        self.path = path
        self.cut_bytes = cut_bytes  # bytes of a torn last line cut at open (0 if none)
        self._fd = fd
        self._keys = keys
        self._failed: str | None = None
        # appends made, and how many of them the last finished sync covers (at open: the
        # first sync is needed); counted, not flagged, so that a sync running on another
        # thread while the next page is appended never takes that page for synced
        self._writes = 1
        self._synced = 0

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ResultFile:
        """Open or create `path`; raise ResultFileError if it is not a result file or is in use."""
        path = Path(path)
        try:
            # O_NONBLOCK: a FIFO without a reader fails here instead of hanging; no effect on files
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise ResultFileError(f"cannot open output file {path}: {exc.strerror}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ResultFileError(
                    f"output path {path} is not a regular file; choose a file path"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultFileError(
                    f"output file {path} is in use by another process; wait for it to end "
                    "or write to another path"
                ) from None
            with open(path, "rb") as reader:
                keys, good_bytes, size = _read_keys(path, reader)
            if good_bytes < size:
                os.ftruncate(fd, good_bytes)
                os.fsync(fd)
            # at every open, not only when made here: a run killed between making the file
            # and this sync left a name no later sync of the file itself makes durable
            fsync_dir(path.parent)
        except OSError as exc:
            os.close(fd)
            raise ResultFileError(f"cannot read output file {path}: {exc.strerror}") from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, keys, size - good_bytes)

    def __contains__(self, key: str) -> bool:
        return held(key) in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def write(self, lines: Sequence[bytes], keys: Sequence[str]) -> int:
        """Append the lines whose key is not yet in the file; return how many were appended.

        Each line is one JSON object ending in a newline; `keys[i]` is
        `line_key` of `lines[i]` (from `page_keys`).
        """
        self._check_usable()
        if len(lines) != len(keys):
            raise ValueError(f"write got {len(lines)} lines but {len(keys)} keys")
        new_keys: dict[Held, None] = {}  # insertion-ordered: a key repeated counts once
        new_lines = []
        for line, key in zip(lines, map(held, keys), strict=True):
            if key not in self._keys and key not in new_keys:
                if not line.endswith(b"\n"):
                    raise ValueError(f"line for key {key!r} does not end with a newline")
                new_keys[key] = None
                new_lines.append(line)
        if new_lines:
            self._append(b"".join(new_lines))
            self._keys.update(new_keys)
        return len(new_lines)

    def _append(self, data: bytes) -> None:
        if not data:
            return
        view = memoryview(data)
        self._writes += 1
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._failed = f"a write failed ({exc.strerror})"
            raise ResultFileError(
                f"writing output file {self.path} failed: {exc.strerror}; free the space "
                "or fix the disk, then run again (the torn end is cut when it is reopened)"
            ) from exc

    def write_page(self, data: bytes, keys: Sequence[str]) -> int:
        """Append the lines of `data` (whole lines; `keys[i]` is the key of line i) whose key
        is not yet in the file; return how many were appended. A page
        whose keys are all new is written as it is, in one piece; otherwise line by line,
        as `write`."""
        return self._write_page(data, list(map(held, keys)), keys)

    def write_custom_ids(self, data: bytes, custom_ids: Sequence[str]) -> int:
        """`write_page` for lines that all have a custom_id (none null): line i's key is
        `custom_id:` + `custom_ids[i]`, without that string being made."""
        return self._write_page(data, custom_ids, None)

    def _write_page(self, data: bytes, keys: Sequence[Held], given: Sequence[str] | None) -> int:
        self._check_usable()
        if data and not data.endswith(b"\n"):
            raise ValueError(f"write_page got {len(keys)} keys and a buffer of partial lines")
        lines = int(np.count_nonzero(np.frombuffer(data, np.uint8) == NEWLINE))  # 6x bytes.count
        if lines != len(keys):
            raise ValueError(f"write_page got {lines} lines but {len(keys)} keys")
        if self._keys.isdisjoint(keys):
            before = len(self._keys)
            self._keys.update(keys)
            if len(self._keys) - before == len(keys):
                try:
                    self._append(data)
                except ResultFileError:
                    self._keys.difference_update(keys)  # none was there before
                    raise
                return len(keys)
            self._keys.difference_update(keys)  # a key twice in the page: none was there before
        if given is None:
            given = list(map(CUSTOM_ID_KEY.__add__, keys))
        return self.write(split_lines(data), given)

    def sync(self) -> None:
        """fsync: everything written before this call is on disk when it returns (a no-op
        when nothing was written since the last sync). It may run on another thread while
        the caller appends more (collector/results_client.py): those appends wait for the
        next sync."""
        self._check_usable()
        writes = self._writes
        if self._synced >= writes:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._failed = f"an fsync failed ({exc.strerror})"
            raise ResultFileError(
                f"syncing output file {self.path} failed: {exc.strerror}; what was written "
                "since the last sync may be lost: run again, and the file is re-read"
            ) from exc
        self._synced = max(self._synced, writes)

    def close(self) -> None:
        """Close the file (without a sync: call `sync` first to keep what was written)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise ResultFileError(f"output file {self.path} is closed")
        if self._failed is not None:
            raise ResultFileError(
                f"output file {self.path} is unusable after {self._failed}; open it again"
            )

    def __enter__(self) -> ResultFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_keys(path: Path, file: Any) -> tuple[set[Held], int, int]:
    """(keys as held, bytes of whole lines, file size); raise ResultFileError at the first bad
    line."""
    keys: set[Held] = set()
    good_bytes = 0
    file.seek(0)
    for number, line in enumerate(file, 1):
        if not line.endswith(b"\n"):  # torn: the writer died before the newline
            return keys, good_bytes, good_bytes + len(line)
        if b"\0" in line:  # no JSON line holds a NUL: sectors of an unsynced write-back that
            # never came (the power went); nothing from here on was synced or acknowledged
            return keys, good_bytes, os.fstat(file.fileno()).st_size
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise _not_ours(path, number, f"not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise _not_ours(path, number, f"a JSON {type(record).__name__}, not an object")
        if "custom_id" not in record:
            raise _not_ours(path, number, "an object without a custom_id field")
        custom_id, line_id = record["custom_id"], record.get("id")
        if custom_id is not None and not isinstance(custom_id, str):
            raise _not_ours(path, number, f"custom_id is {custom_id!r}, not a string or null")
        if not isinstance(line_id, str):
            raise _not_ours(path, number, f"id is {line_id!r}, not a string")
        keys.add(("id", line_id) if custom_id is None else custom_id)
        good_bytes += len(line)
    return keys, good_bytes, good_bytes


def _not_ours(path: Path, number: int, what: str) -> ResultFileError:
    return ResultFileError(
        f"{path}: line {number} is {what}; it is not an OpenAI Batch result file this client "
        "wrote, so it is left as it is: move it away or choose another output path"
    )
