"""Split a binary stream into numbered lines, reading blocks, never the whole stream.

Memory is bounded by `block_bytes` plus `max_line_bytes`: a line longer than
`max_line_bytes` (newline excluded) is reported as `None` under its number
as soon as it is known to be too long, and the rest of it is skipped as it
streams by. A UTF-8 byte order mark at the start of the stream is dropped.
Lines keep any trailing `\\r` (JSON treats it as whitespace).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from pipeline.core.errors import IngestError

BLOCK_BYTES = 1 << 20
_BOM = b"\xef\xbb\xbf"


def numbered_lines(
    stream: BinaryIO, *, max_line_bytes: int, name: str = "<stream>", block_bytes: int = BLOCK_BYTES
) -> Iterator[tuple[int, bytes | None]]:
    """Yield (1-based line number, line without its newline, or None if it is too long)."""
    number = 0
    pending: list[bytes] = []  # pieces of the line being read
    pending_bytes = 0
    skipping = False  # inside a too-long line that was already reported
    first = True
    while True:
        block = _read(stream, block_bytes, name)
        if not block:
            break
        if first:  # a short first read may hold only part of the byte order mark
            while len(block) < len(_BOM) and (more := _read(stream, block_bytes, name)):
                block += more
            block = block.removeprefix(_BOM)
            first = False
        pieces = block.split(b"\n")
        for piece in pieces[:-1]:  # each ends a line
            if skipping:
                skipping = False
                pending, pending_bytes = [], 0
                continue
            number += 1
            if pending_bytes + len(piece) > max_line_bytes:
                yield number, None
            else:
                yield number, b"".join((*pending, piece)) if pending else piece
            pending, pending_bytes = [], 0
        tail = pieces[-1]
        if skipping or not tail:
            continue
        pending.append(tail)
        pending_bytes += len(tail)
        if pending_bytes > max_line_bytes:
            number += 1
            yield number, None
            skipping = True
            pending, pending_bytes = [], 0
    if pending:
        yield number + 1, b"".join(pending)


def _read(stream: BinaryIO, size: int, name: str) -> bytes:
    try:
        block = stream.read(size)
    except OSError as exc:
        raise IngestError(
            f"{name}: cannot read the input ({exc}); check the file and retry"
        ) from exc
    if isinstance(block, str):
        raise IngestError(
            f"{name}: the input stream is in text mode; open it in binary mode ('rb')"
        )
    if block is None:
        raise IngestError(f"{name}: the input stream is non-blocking; pass a blocking stream")
    return bytes(block)
