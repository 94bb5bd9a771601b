"""A multipart upload (`POST /v1/files`) streamed to disk, with memory bounded by one chunk.

The body is parsed as it arrives (python-multipart's streaming parser): the
`file` part's bytes go straight to a `.upload-*` file in the file store and
each complete line is checked to be one JSON object (the Batch API's JSONL);
the `purpose` part is a few bytes kept in memory. Nothing is buffered beyond
the request chunk being parsed and one partial line.

Only when the whole body has arrived and checked out is the file fsynced and
given an id (api/file_store.py). Any failure (a bad part, a bad line, a body
cut off, an upload too large) removes the temporary file: nothing is stored
half-way, and the error says what to fix.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from python_multipart.multipart import MultipartParser, parse_options_header

from api.errors import ApiError, invalid

MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose)
MAX_PENDING_LINE = 64 << 20  # one JSONL line longer than this is refused while it arrives
WRITEBACK_BYTES = 8 << 20  # the disk is asked to start writing every this many bytes received
CHECK_BYTES = 1 << 20  # lines starting in the first MiB are parsed at upload; the rest at batch
# validation (parsing every line here would halve the upload rate: bench/http_api.py)


class JsonlChecker:
    """Checks, as bytes arrive, that every non-blank line starting in the first `check_bytes`
    is one JSON object, and that the file has a non-blank line."""

    def __init__(self, check_bytes: int = CHECK_BYTES) -> None:
        self.pending = b""
        self.lines = 0  # non-blank lines seen
        self.number = 0  # line number of the last complete line
        self.left = check_bytes

    def feed(self, data: bytes | memoryview) -> None:
        if self.left <= 0:  # past the checked head: only whether there is any line at all
            self.pending = b""  # the line it ends is not checked here
            if not self.lines and bytes(data).strip():
                self.lines = 1
            return
        data = bytes(data)
        self.left -= len(data)
        if b"\n" not in data:
            self.pending += data
            if len(self.pending) > MAX_PENDING_LINE:
                raise invalid(
                    f"line {self.number + 1} of the file is longer than {MAX_PENDING_LINE} bytes",
                    param="file",
                    code="invalid_file_format",
                )
            return
        parts = (self.pending + data).split(b"\n")
        self.pending = parts.pop()
        for line in parts:
            self._check(line)

    def finish(self) -> None:
        if self.pending:
            self._check(self.pending)
            self.pending = b""
        if not self.lines:
            raise invalid(
                "The file has no lines: a batch input file is JSONL, one request per line",
                param="file",
                code="invalid_file_format",
            )

    def _check(self, line: bytes) -> None:
        self.number += 1
        if self.number == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]  # a byte order mark
        if not line.strip():
            return
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise invalid(
                f"Invalid file format for Batch API: line {self.number} is not JSON ({exc}); "
                "upload a JSONL file, one JSON object per line",
                param="file",
                code="invalid_file_format",
            ) from None
        if not isinstance(value, dict):
            raise invalid(
                f"Invalid file format for Batch API: line {self.number} is a JSON "
                f"{type(value).__name__}, not an object",
                param="file",
                code="invalid_file_format",
            )
        self.lines += 1


class UploadParser:
    """Parses one multipart body into `tmp`: `feed` each chunk, then `finish`."""

    def __init__(self, content_type: str | None, tmp: Path, max_bytes: int) -> None:
        kind, params = parse_options_header(content_type or "")
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise invalid(
                f"The body must be multipart/form-data with a boundary (got content type "
                f"{content_type!r}); send the file as a form field 'file' and 'purpose=batch'",
                code="invalid_multipart",
            )
        self.tmp = tmp
        self.max_bytes = max_bytes
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.size = 0
        self._unstarted = 0  # bytes written since writeback was last started
        self.checker = JsonlChecker()
        self.fd = -1
        self._name = ""
        self._header_field = b""
        self._headers: dict[bytes, bytes] = {}
        self._ended = False
        self._error: ApiError | None = None
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field_data,
                "on_header_value": self._header_value_data,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_end": self._end,
            },
        )

    # ---- parser callbacks ------------------------------------------------------------------
    def _part_begin(self) -> None:
        self._headers = {}
        self._header_field = b""
        self._name = ""

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field = data[start:end].lower()

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        key = self._header_field
        self._headers[key] = self._headers.get(key, b"") + data[start:end]

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.fd >= 0:
                raise invalid("The body has two 'file' parts; send one file", param="file")
            filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            self.filename = os.path.basename(filename) or "upload.jsonl"
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            piece = memoryview(data)[start:end]  # not copied: written as it lies in the chunk
            self.size += len(piece)
            if self.size > self.max_bytes:
                raise ApiError(
                    413,
                    f"The file is larger than this server's limit of {self.max_bytes} bytes "
                    "(api.max_upload_bytes); split it into several batches",
                    param="file",
                    code="file_too_large",
                )
            view = piece
            while view:
                view = view[os.write(self.fd, view) :]
            self.checker.feed(piece)
            self._written(len(piece))
        elif self._name:
            value = self.fields.get(self._name, b"") + data[start:end]
            if len(value) > MAX_FIELD_BYTES:
                raise invalid(f"The form field {self._name!r} is too long", param=self._name)
            self.fields[self._name] = value

    def _written(self, n: int) -> None:
        """Start the disk writing what arrived, without waiting for it (POSIX_FADV_DONTNEED
        starts writeback of dirty pages and drops only clean ones): the disk writes while the
        rest arrives, and the fsync at the end waits only for the last few MiB."""
        self._unstarted += n
        if self._unstarted >= WRITEBACK_BYTES:
            os.posix_fadvise(
                self.fd, self.size - self._unstarted, self._unstarted, os.POSIX_FADV_DONTNEED
            )
            self._unstarted = 0

    def _end(self) -> None:
        self._ended = True

    # ---- driving ---------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except ApiError:
            raise
        except Exception as exc:  # python-multipart's parse errors
            raise invalid(
                f"The multipart body is malformed: {exc}", code="invalid_multipart"
            ) from None

    def finish(self) -> None:
        """After the last chunk: the body was complete and the file is good (not yet synced)."""
        if not self._ended:
            raise invalid(
                "The multipart body ended before its closing boundary (the upload was cut "
                "off); upload the file again",
                code="invalid_multipart",
            )
        if self.fd < 0:
            raise invalid(
                "The body has no 'file' part; send the file as form field 'file'", param="file"
            )
        if self.size == 0:
            raise invalid(
                "The file is empty (0 bytes); upload a JSONL file of requests",
                param="file",
                code="invalid_file_format",
            )
        self.checker.finish()

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


async def receive_upload(stream: AsyncIterator[bytes], parser: UploadParser) -> None:
    """Feed the whole request body to `parser`; the caller discards on any exception."""
    async for chunk in stream:
        if chunk:
            parser.feed(chunk)
    parser.finish()
