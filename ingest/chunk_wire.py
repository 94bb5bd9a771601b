"""An InputChunk as a wire message (producer -> front -> tokenizer) and back.

| array        | dtype | meaning                                               |
|--------------|-------|-------------------------------------------------------|
| line         | <u8   | line number of each item                              |
| ids          | u1    | custom_ids, UTF-8, back to back                       |
| ids_offsets  | <i8   | n + 1 offsets into `ids`                              |
| model_index  | <u4   | into meta `models`                                    |
| shape_index  | <u4   | into meta `shapes`                                    |
| tokens       | <u4   | pre-tokenised items' tokens, back to back             |
| offsets      | <i8   | n + 1 offsets into `tokens` (equal for text items)    |
| text_items   | <i8   | positions of the items whose prompt is text           |
| texts        | u1    | orjson list of their prompts (a string, or [[role, content], ...]) |
| errors       | u1    | orjson list of [line, custom_id, code, message]       |

Meta: `index` (the chunk number), `first_line`, `last_line`, `models`
(names) and `shapes` (canonical shape dicts), and `fanout` (only when a
line has several parts: `[[line, parts, index of part 1], ...]`, whose items
then repeat the line number; the item indexes follow from it, see
ingest/input_chunk.py; a message without it has one item per line). Everything from the network
is checked again by the front before it is used.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np
import orjson

from ingest.input_chunk import InputChunk, fanout_entry, fanout_indexes, fanout_record
from ingest.line_errors import LineError, Rejected
from ingest.request_shape import SHAPE_PARAMETERS, Shape, parse_shape
from pipeline.core.errors import WireError
from pipeline.core.ragged import offsets_of, offsets_problem

ARRAYS = (
    "line",
    "ids",
    "ids_offsets",
    "model_index",
    "shape_index",
    "tokens",
    "offsets",
    "text_items",
    "texts",
    "errors",
)


def _blob(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    joined = "".join(strings)
    if joined.isascii():  # one byte a character: one encode for all
        offsets = offsets_of(np.fromiter(map(len, strings), np.int64, len(strings)))
        return np.frombuffer(joined.encode("ascii"), dtype=np.uint8), offsets
    encoded = [s.encode() for s in strings]
    offsets = offsets_of(np.fromiter(map(len, encoded), np.int64, len(encoded)))
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def _texts(loaded: list) -> tuple:
    """The chunk's prompts from their JSON: strings as they are, chat messages as tuples."""
    if all(map(isinstance, loaded, repeat(str))):  # text only: no loop in Python
        return tuple(loaded)
    return tuple(t if isinstance(t, str) else tuple((str(r), str(c)) for r, c in t) for t in loaded)


def _json_array(value: Any) -> np.ndarray:
    return np.frombuffer(orjson.dumps(value), dtype=np.uint8)


def chunk_to_wire(chunk: InputChunk) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    ids, ids_offsets = _blob(list(chunk.custom_ids))
    texts = list(chunk.texts)  # strings as they are (no loop in Python); chat as lists
    if not all(map(isinstance, texts, repeat(str))):
        texts = [t if isinstance(t, str) else [list(m) for m in t] for t in texts]
    errors = [[e.line, e.custom_id, e.code, e.message] for e in chunk.errors]
    meta = {
        "index": chunk.index,
        "first_line": chunk.first_line,
        "last_line": chunk.last_line,
        "models": list(chunk.models),
        "shapes": [s.as_dict() for s in chunk.shapes],
    }
    if chunk.fanout:
        meta["fanout"] = [fanout_record(f) for f in chunk.fanout]
    arrays = {
        "line": chunk.line.astype("<u8", copy=False),
        "ids": ids,
        "ids_offsets": ids_offsets,
        "model_index": chunk.model_index.astype("<u4", copy=False),
        "shape_index": chunk.shape_index.astype("<u4", copy=False),
        "tokens": chunk.tokens.astype("<u4", copy=False),
        "offsets": chunk.offsets.astype("<i8", copy=False),
        "text_items": chunk.text_items.astype("<i8", copy=False),
        "texts": _json_array(texts),
        "errors": _json_array(errors),
    }
    return meta, arrays


def chunk_from_wire(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> InputChunk:
    """Rebuild and sanity-check a chunk; WireError naming what is inconsistent."""
    missing = [name for name in ARRAYS if name not in arrays]
    if missing:
        raise WireError(f"chunk message lacks arrays {missing}")
    for name in ARRAYS:  # flat integers only: no floats, structs or matrices to cast or index
        _check(
            arrays[name].ndim == 1 and arrays[name].dtype.kind in "ui",
            f"{name} is {arrays[name].dtype.str} x {list(arrays[name].shape)}, not a 1-d int array",
        )
    try:
        n = len(arrays["line"])
        ids_offsets = _offsets(arrays["ids_offsets"], n, len(arrays["ids"]), "custom_id")
        offsets = _offsets(arrays["offsets"], n, len(arrays["tokens"]), "token")
        for name in ("model_index", "shape_index"):
            _check(len(arrays[name]) == n, f"{name} has {len(arrays[name])} entries for {n} items")
        models = [str(m) for m in meta["models"]]
        shapes = tuple(_shape(s) for s in meta["shapes"])
        _check(n == 0 or int(arrays["model_index"].max()) < len(models), "model_index out of range")
        _check(n == 0 or int(arrays["shape_index"].max()) < len(shapes), "shape_index out of range")
        custom_ids = _strings(arrays["ids"].tobytes(), ids_offsets)
        texts = _texts(orjson.loads(arrays["texts"].tobytes()))
        text_items = arrays["text_items"].astype(np.int64)
        _check(len(text_items) == len(texts), "text_items and texts disagree")
        _check(
            len(text_items) == 0 or (int(text_items.min()) >= 0 and int(text_items.max()) < n),
            "text_items out of range",
        )
        _check(bool(np.all(np.diff(text_items) > 0)), "text_items are not increasing")
        first_line, last_line = int(meta["first_line"]), int(meta["last_line"])
        line = arrays["line"]  # an item's index in its job is its line - 1 (a u32)
        fanout = tuple(fanout_entry(f) for f in meta.get("fanout", ()))
        step = np.diff(line.astype(np.int64))
        _check(
            n == 0
            or (
                1 <= first_line <= int(line.min())
                and int(line.max()) <= last_line < 2**31
                and bool(np.all(step >= 0 if fanout else step > 0))
            ),
            "line numbers are not increasing within first_line..last_line",
        )
        item_index = None
        if fanout:
            item_index = fanout_indexes(line, fanout)
            _check(item_index is not None, "fanout disagrees with the items' line numbers")
            _check(int(item_index.max()) < 2**32, "a part's index is beyond 2**32 - 1")
        errors = tuple(
            LineError(int(a), None if b is None else str(b), str(c), str(d))
            for a, b, c, d in orjson.loads(arrays["errors"].tobytes())
        )
        return InputChunk(
            index=int(meta["index"]),
            first_line=first_line,
            last_line=last_line,
            line=arrays["line"].astype(np.uint64),
            custom_ids=custom_ids,
            models=tuple(models),
            model_index=arrays["model_index"].astype(np.int64),
            shapes=shapes,
            shape_index=arrays["shape_index"].astype(np.int64),
            tokens=np.ascontiguousarray(arrays["tokens"], dtype=np.uint32),
            offsets=offsets,
            text_items=text_items,
            texts=texts,
            errors=errors,
            item_index=item_index,
            fanout=fanout,
        )
    except WireError:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, orjson.JSONDecodeError) as exc:
        raise WireError(f"chunk message is malformed: {type(exc).__name__}: {exc}") from None


def _strings(blob: bytes, offsets: np.ndarray) -> tuple[str, ...]:
    """The UTF-8 strings blob[offsets[i]:offsets[i + 1]], without a decode per string.

    When no string holds a NUL (custom_ids about never do), a NUL goes between
    each two, and one decode and one split make them all; a multi-byte
    character cut by an offset is then invalid UTF-8, as a decode per string
    would find. Raises UnicodeDecodeError on bad UTF-8.
    """
    n = len(offsets) - 1
    if n <= 0:
        return ()
    data = np.frombuffer(blob, dtype=np.uint8)
    if not (data == 0).any():
        joined = np.insert(data, offsets[1:-1], 0).tobytes().decode()
        return tuple(joined.split("\x00"))
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    return tuple(blob[a:b].decode() for a, b in zip(starts, ends, strict=True))


def _offsets(raw: np.ndarray, n: int, blob: int, what: str) -> np.ndarray:
    """n + 1 offsets from 0 to `blob`, never decreasing (pipeline/core/ragged.py's rule), as int64;
    WireError naming the array (`what`) and the problem otherwise."""
    problem = offsets_problem(raw, n, blob)
    _check(problem is None, f"{what} offsets into {blob} entries: {problem}")
    return raw.astype(np.int64)  # in 0..blob now: no wrap-around


def _shape(spec: object) -> Shape:
    """A shape from the wire, checked like a request body's (so dispatch can trust it)."""
    fields = set(Shape.__slots__)
    _check(isinstance(spec, dict) and set(spec) <= fields, f"shape {spec!r} is not a shape")
    endpoint = spec.get("endpoint")
    _check(endpoint in SHAPE_PARAMETERS, f"shape endpoint {endpoint!r} is not an endpoint")
    try:
        return parse_shape({**spec, "stop": spec.get("stop") or None}, endpoint)  # [] = none
    except Rejected as exc:
        raise WireError(f"chunk message is inconsistent: shape {spec!r}: {exc}") from None


def _check(ok: bool, problem: str) -> None:
    if not ok:
        raise WireError(f"chunk message is inconsistent: {problem}")
