"""The ingest ring records (ITEMS, KEYED): what flows front/tokenizer -> router -> writer.

Both record kinds start with a fixed header row (a numpy structured array),
then the arrays listed; every array starts 8-byte aligned (pipeline.transport.ring).
Tokens are never turned into Python objects on the way.

ITEMS (kind 1), front or tokenizer -> router: items of one chunk, any shapes.

| array       | dtype          | meaning                                           |
|-------------|----------------|---------------------------------------------------|
| head        | ITEMS_HEAD x 1 | job_no, chunk, n, n_tokens, deadline_ns, meta_bytes |
| meta        | u1[meta_bytes] | orjson `{"models": [...], "shapes": [{...}, ...]}` |
| index       | u4[n]          | item index in its job (line number - 1)           |
| model_index | u4[n]          | into meta.models                                  |
| shape_index | u4[n]          | into meta.shapes                                  |
| lengths     | u4[n]          | tokens per item                                   |
| tokens      | u4[n_tokens]   | all items' tokens, back to back                   |

KEYED (kind 2), router -> writer: items of one chunk and one (model, shape, lane).

| array   | dtype          | meaning                                              |
|---------|----------------|------------------------------------------------------|
| head    | KEYED_HEAD x 1 | job_no, chunk, n, width, shape, lane, deadline_ns, name_bytes |
| name    | u1[name_bytes] | the model name, UTF-8                                |
| index   | u4[n]          | item index in its job                                |
| lengths | u4[n]          | tokens per item                                      |
| tokens  | u4[n, width]   | zero-padded to the longest item (width <= lane)      |

`deadline_ns` is CLOCK_MONOTONIC (one clock for every process on the host):
a writer drops a record past it, because by then the front has given up on
the chunk and its producer will retry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from pipeline.transport.ring import Ring
from pipeline.transport.ring_layout import record_arrays

ITEMS = 1
KEYED = 2

ITEMS_HEAD = np.dtype(
    [
        ("job_no", "<u8"),
        ("chunk", "<u4"),
        ("n", "<u4"),
        ("n_tokens", "<u8"),
        ("deadline_ns", "<u8"),
        ("meta_bytes", "<u4"),
        ("pad", "<u4"),
    ]
)
KEYED_HEAD = np.dtype(
    [
        ("job_no", "<u8"),
        ("chunk", "<u4"),
        ("n", "<u4"),
        ("width", "<u4"),
        ("shape", "<u4"),
        ("lane", "<u4"),
        ("name_bytes", "<u4"),
        ("deadline_ns", "<u8"),
    ]
)


@dataclass(frozen=True, eq=False)
class Items:
    job_no: int
    chunk: int
    deadline_ns: int
    models: list[str]
    shapes: list[dict[str, Any]]
    index: np.ndarray
    model_index: np.ndarray
    shape_index: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True, eq=False)
class Keyed:
    job_no: int
    chunk: int
    deadline_ns: int
    model: str
    shape: int
    lane: int
    index: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray  # [n, width]


def put_items(ring: Ring, items: Items) -> int | None:
    """Write an ITEMS record; None if the ring is full."""
    meta = orjson.dumps({"models": items.models, "shapes": items.shapes})
    head = np.zeros(1, ITEMS_HEAD)
    head[0] = (
        items.job_no,
        items.chunk,
        len(items.index),
        len(items.tokens),
        items.deadline_ns,
        len(meta),
        0,
    )
    return ring.put(
        ITEMS,
        head,
        meta,
        items.index.astype("<u4", copy=False),
        items.model_index.astype("<u4", copy=False),
        items.shape_index.astype("<u4", copy=False),
        items.lengths.astype("<u4", copy=False),
        items.tokens.astype("<u4", copy=False),
    )


def read_items(payload: memoryview) -> Items:
    """Views of an ITEMS record (valid until the ring is released)."""
    head = np.frombuffer(payload, ITEMS_HEAD, count=1)[0]
    n, n_tokens = int(head["n"]), int(head["n_tokens"])
    _, meta, index, model_index, shape_index, lengths, tokens = record_arrays(
        payload,
        (ITEMS_HEAD, 1),
        ("u1", int(head["meta_bytes"])),
        ("<u4", n),
        ("<u4", n),
        ("<u4", n),
        ("<u4", n),
        ("<u4", n_tokens),
    )
    decoded = orjson.loads(meta.tobytes())
    return Items(
        int(head["job_no"]),
        int(head["chunk"]),
        int(head["deadline_ns"]),
        decoded["models"],
        decoded["shapes"],
        index,
        model_index,
        shape_index,
        lengths,
        tokens,
    )


def put_keyed(ring: Ring, keyed: Keyed) -> int | None:
    """Write a KEYED record; None if the ring is full."""
    name = keyed.model.encode()
    n, width = keyed.tokens.shape
    head = np.zeros(1, KEYED_HEAD)
    head[0] = (
        keyed.job_no,
        keyed.chunk,
        n,
        width,
        keyed.shape,
        keyed.lane,
        len(name),
        keyed.deadline_ns,
    )
    return ring.put(
        KEYED,
        head,
        name,
        keyed.index.astype("<u4", copy=False),
        keyed.lengths.astype("<u4", copy=False),
        np.ascontiguousarray(keyed.tokens, dtype="<u4"),
    )


def read_keyed(payload: memoryview) -> Keyed:
    head = np.frombuffer(payload, KEYED_HEAD, count=1)[0]
    n, width = int(head["n"]), int(head["width"])
    _, name, index, lengths, tokens = record_arrays(
        payload,
        (KEYED_HEAD, 1),
        ("u1", int(head["name_bytes"])),
        ("<u4", n),
        ("<u4", n),
        ("<u4", (n, width)),
    )
    return Keyed(
        int(head["job_no"]),
        int(head["chunk"]),
        int(head["deadline_ns"]),
        name.tobytes().decode(),
        int(head["shape"]),
        int(head["lane"]),
        index,
        lengths,
        tokens,
    )


MAX_RECORD_BYTES = 16 << 20  # a 4096-item chunk of 512 tokens in one record; rings are 4x this


def split_items(items: Items, max_bytes: int = MAX_RECORD_BYTES) -> list[Items]:
    """Pieces of `items` whose tokens take at most about `max_bytes` each (at least one item)."""
    per_item = items.lengths.astype(np.int64) * 4 + 16
    if int(per_item.sum()) <= max_bytes:
        return [items]
    piece_of = np.cumsum(per_item) // max_bytes
    bounds = np.flatnonzero(np.diff(piece_of)) + 1
    starts = np.concatenate(([0], np.cumsum(items.lengths.astype(np.int64))))
    pieces = []
    for a, b in zip(
        np.concatenate(([0], bounds)).tolist(),
        np.concatenate((bounds, [len(per_item)])).tolist(),
        strict=True,
    ):
        pieces.append(
            Items(
                items.job_no,
                items.chunk,
                items.deadline_ns,
                items.models,
                items.shapes,
                items.index[a:b],
                items.model_index[a:b],
                items.shape_index[a:b],
                items.lengths[a:b],
                items.tokens[starts[a] : starts[b]],
            )
        )
    return pieces


def split_keyed(keyed: Keyed, max_bytes: int = MAX_RECORD_BYTES) -> list[Keyed]:
    """Pieces of a keyed group of at most about `max_bytes` each (at least one row)."""
    n, width = keyed.tokens.shape
    rows = max(1, max_bytes // (width * 4 + 8))
    if n <= rows:
        return [keyed]
    return [
        Keyed(
            keyed.job_no,
            keyed.chunk,
            keyed.deadline_ns,
            keyed.model,
            keyed.shape,
            keyed.lane,
            keyed.index[a : a + rows],
            keyed.lengths[a : a + rows],
            keyed.tokens[a : a + rows],
        )
        for a in range(0, n, rows)
    ]
