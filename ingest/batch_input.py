"""Stream an OpenAI Batch JSONL file into checked chunks of at most N lines.

    for chunk in iter_batch_input("requests.jsonl", settings):
        chunk = tokenize_chunk(chunk, tokenizers, settings)   # ingest.tokenize
        ...  # route chunk.tokens / chunk.offsets by model, shape and lane; write chunk.errors

The input is read in blocks (`ingest.jsonl_lines`), so memory is bounded by
one chunk however large the file is. A file with no lines at all (empty, or
only a byte order mark) is one empty chunk covering lines 1..0, so its job
exists and completes with nothing in it, like a file of blank lines. Each non-blank line is checked alone
(`ingest.line_parser`); a bad line becomes a `LineError` in its chunk and
the other lines go on. Custom_ids are checked for repeats across the whole
job with a compact digest set (`ingest.custom_ids`): every line whose
custom_id can be read claims it, so a later line with the same custom_id is
a `duplicate_custom_id` whatever else is wrong with either line.

With `strict=True` the first bad line raises `InputLineError` instead, after
the chunks before it have been yielded. To refuse a file before anything is
queued, run a strict pass first (both steps strict, chunks discarded), then
the real one:

    for chunk in iter_batch_input(path, settings, strict=True):
        tokenize_chunk(chunk, tokenizers, settings, strict=True)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import BinaryIO

import numpy as np

from config.settings import Settings
from ingest.catalog import ModelCatalog
from ingest.custom_ids import CustomIdSet
from ingest.input_chunk import ChunkBuilder, InputChunk
from ingest.jsonl_lines import numbered_lines
from ingest.line_errors import DUPLICATE_CUSTOM_ID, LINE_TOO_LONG, LineError, Rejected, show
from ingest.line_parser import parse_line
from pipeline.core.errors import IngestError

Source = str | os.PathLike[str] | BinaryIO


def iter_batch_input(
    source: Source,
    settings: Settings,
    *,
    chunk_lines: int | None = None,
    strict: bool = False,
    max_line_bytes: int | None = None,
    custom_ids: CustomIdSet | None = None,
) -> Iterator[InputChunk]:
    """Yield checked chunks of at most `chunk_lines` lines from a path or binary stream.

    `chunk_lines` defaults to `ingest.chunk_items`, `max_line_bytes` to
    `ingest.max_message_bytes`. Pass the job's `custom_ids` set to check
    repeats across several sources of one job (not to a checking pass: the
    set records every id it sees). A path is opened and closed
    here; a stream is read from where it stands and left open. Raises
    IngestError if the source cannot be opened or read, InputLineError on the
    first bad line in strict mode; otherwise bad lines become error records.
    """
    chunk_lines = settings.ingest.chunk_items if chunk_lines is None else chunk_lines
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines = {chunk_lines}; a chunk holds at least 1 line")
    limit = settings.ingest.max_message_bytes if max_line_bytes is None else max_line_bytes
    seen = CustomIdSet() if custom_ids is None else custom_ids
    catalog = ModelCatalog.from_settings(settings)
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        try:
            stream: BinaryIO = open(source, "rb")  # noqa: SIM115 - closed in the finally below
        except OSError as exc:
            raise IngestError(
                f"{name}: cannot open the input file ({exc.strerror}); check the path"
            ) from exc
    else:
        name, stream = str(getattr(source, "name", "<stream>")), source
    try:
        lines = numbered_lines(stream, max_line_bytes=limit, name=name)
        for chunk in _chunks(lines, catalog, seen, chunk_lines, limit):
            if strict and chunk.errors:
                raise chunk.errors[0].to_exception()
            yield chunk
    finally:
        if stream is not source:
            stream.close()


def _chunks(
    lines: Iterator[tuple[int, bytes | None]],
    catalog: ModelCatalog,
    seen: CustomIdSet,
    chunk_lines: int,
    max_line_bytes: int,
) -> Iterator[InputChunk]:
    index = 0
    builder = ChunkBuilder(index, first_line=1)
    claims: list[tuple[int, str]] = []  # (line, custom_id) of every line with a readable one
    number = 0
    for number, raw in lines:
        if raw is None:
            reason = (
                f"the line is longer than {max_line_bytes} bytes; split the request or raise "
                "ingest.max_message_bytes"
            )
            builder.errors.append(LineError.at(number, None, LINE_TOO_LONG, reason))
        elif raw.strip():
            try:
                item = parse_line(raw, catalog)
            except Rejected as exc:
                builder.errors.append(LineError.at(number, exc.custom_id, exc.code, exc.reason))
                if exc.custom_id is not None:
                    claims.append((number, exc.custom_id))
            else:
                builder.add(number, item)
                claims.append((number, item.custom_id))
        if number - builder.first_line + 1 == chunk_lines:
            yield _finish(builder, claims, seen, number)
            index += 1
            builder = ChunkBuilder(index, first_line=number + 1, next_part=builder.next_part)
            claims = []
    if number >= builder.first_line or index == 0:  # an empty file is one empty chunk
        yield _finish(builder, claims, seen, number)


def _finish(
    builder: ChunkBuilder, claims: list[tuple[int, str]], seen: CustomIdSet, last_line: int
) -> InputChunk:
    """Build the chunk, then turn lines whose custom_id was already used into duplicates."""
    chunk = builder.build(last_line)
    repeated = seen.add([custom_id for _, custom_id in claims])
    if not repeated.any():
        return chunk
    duplicates = {}
    for i in repeated.nonzero()[0].tolist():
        line, custom_id = claims[i]
        reason = (
            f"custom_id {show(custom_id)} is already used by an earlier line of this job; "
            "give every line its own custom_id"
        )
        duplicates[line] = LineError.at(line, custom_id, DUPLICATE_CUSTOM_ID, reason)
    drop = np.isin(chunk.line, np.array(list(duplicates), dtype=np.uint64))
    chunk = replace(chunk, errors=tuple(e for e in chunk.errors if e.line not in duplicates))
    return chunk.without(drop, tuple(duplicates.values()))
