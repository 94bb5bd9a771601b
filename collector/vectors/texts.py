"""The text behind a vector: read back from its job's input file, when this host has it.

The store keeps vectors and their global ids (item seqs, pipeline/core/item_seq.py), not the
text that was embedded; the text lived in the input file. `submit` (the producer SDK)
sends that file's absolute path with the job, and the front keeps it in the job's
record (`source`, pipeline/store/job_record.py). For a search hit, `input_texts` opens the job's source, reads the hit's
line, and returns its text only if the line still carries the hit's custom_id (a file
changed or replaced since is never shown as the hit's text). No source, a file gone
or unreadable, or another host: None, and the caller shows the custom_id alone.

The text of a line: `body.input` (a string, or of a list of strings the hit's part:
one vector per input, collector/vectors/sink.py), else
`body.prompt`, else the last message's `content` of `body.messages`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from pipeline.core.errors import FabricError
from pipeline.store.job_files import JobFiles


def line_text(record: Any, part: int = 0) -> str | None:
    """The text an OpenAI Batch input line asks to embed or complete, or None; of a list of
    strings, its item `part` (each input of a list is its own vector)."""
    body = record.get("body") if isinstance(record, dict) else None
    if not isinstance(body, dict):
        return None
    for key in ("input", "prompt"):
        value = body.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value[part] if 0 <= part < len(value) else None
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def _source(data_path: Path, job_id: str) -> Path | None:
    try:
        meta = JobFiles(data_path).read_record(job_id)
    except (OSError, FabricError):  # no such job here, or a record that is not trusted
        return None
    source = meta.get("source")
    return Path(source) if isinstance(source, str) and source else None


def input_texts(
    data_path: Path, hits: list[tuple[str | None, int, str | None, int]]
) -> list[str | None]:
    """The text of each hit, given as (job id, line index, custom_id, part); None where
    unknown."""
    texts: list[str | None] = [None] * len(hits)
    wanted: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for at, (job_id, index, custom_id, _) in enumerate(hits):
        if job_id is not None and custom_id is not None:
            wanted[job_id][index + 1].append(at)
    for job_id, lines in wanted.items():
        source = _source(data_path, job_id)
        if source is None:
            continue
        try:
            with open(source, "rb") as f:
                last = max(lines)
                for number, raw in enumerate(f, start=1):
                    if number in lines:
                        try:
                            record = orjson.loads(raw)
                        except orjson.JSONDecodeError:
                            continue
                        for at in lines[number]:
                            if isinstance(record, dict) and record.get("custom_id") == hits[at][2]:
                                texts[at] = line_text(record, hits[at][3])
                    if number >= last:
                        break
        except OSError:
            continue  # gone, unreadable, or on the producer's host: no text
    return texts
