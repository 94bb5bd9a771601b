"""How many lines a new job's chunks hold: about `ingest.chunk_items` items, not lines.

A chunk is a fixed number of lines (chunk c covers lines c*L+1 .. (c+1)*L,
ingest/front_stage.py), and nothing of it reaches dispatch before all of it is
checked, tokenised and logged. With lines of several parts (an `input` or
`prompt` list, `n` samples: docs/input-format.md) a chunk of `chunk_items`
lines holds `chunk_items` times the parts: a 1,280-input job of 20 list
lines was one chunk, and the worker waited for all of it before its first
batch, where the same inputs one per line started after the first chunk. So
the submit client sizes a new job's chunks from its first request line:

| first line | lines per chunk |
|---|---|
| k parts (k = list length x `n`) | max(1, chunk_items // k) |
| one part, unreadable, or a stream (nothing to peek at) | chunk_items |

A resumed job keeps the chunk size it was started with (the front checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

PEEK_BYTES = 1 << 22  # a first line longer than this is not sampled


def lines_per_chunk(source: Any, chunk_items: int) -> int:
    """Lines per chunk for a new job read from `source` (see the module docstring)."""
    if not isinstance(source, str | Path):
        return chunk_items
    try:
        with open(source, "rb") as f:
            for raw in f:
                if len(raw) > PEEK_BYTES:
                    return chunk_items
                if raw.strip():
                    return max(1, chunk_items // parts_of(orjson.loads(raw)))
    except (OSError, orjson.JSONDecodeError):
        pass  # the reader reports it, with its line number
    return chunk_items


def parts_of(record: Any) -> int:
    """The parts a request line asks for (1 when it is not a readable request)."""
    body = record.get("body") if isinstance(record, dict) else None
    if not isinstance(body, dict):
        return 1
    prompts = 1
    for key in ("input", "prompt"):
        value = body.get(key)
        if isinstance(value, list) and value and not isinstance(value[0], int | float):
            prompts = len(value)
    n = body.get("n")
    return max(1, prompts * (n if type(n) is int and n > 0 else 1))
