"""Pre-tokenised rows as InputChunks: what `Producer.submit_tokens` sends, with no JSON and
no Python per item.

Rows are a list of uint32 arrays, or a 2-D array (with `lengths` when rows
are padded). Item i gets line number i + 1 and custom_id `custom_ids[i]`
(default `item-<i>`); every item has the one model and shape given.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ingest.input_chunk import InputChunk
from ingest.request_shape import Shape


def token_chunks(
    rows, lengths, custom_ids, model: str, shape: Shape, chunk_lines: int
) -> Iterator[InputChunk]:
    """InputChunks of pre-tokenised rows, `chunk_lines` items each, without Python per item."""
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        n = rows.shape[0]
        lengths = (
            np.full(n, rows.shape[1], np.int64)
            if lengths is None
            else np.asarray(lengths, np.int64)
        )
    else:
        n = len(rows)
    for number, start in enumerate(range(0, n, chunk_lines)):
        stop = min(n, start + chunk_lines)
        if isinstance(rows, np.ndarray) and rows.ndim == 2:
            part = rows[start:stop]
            part_lengths = lengths[start:stop]
            if bool(np.all(part_lengths == part.shape[1])):
                tokens = np.ascontiguousarray(part, dtype=np.uint32).reshape(-1)  # no gather
            else:
                keep = np.arange(part.shape[1])[None, :] < part_lengths[:, None]
                tokens = part[keep].astype(np.uint32)
        else:
            part_rows = [np.asarray(r, np.uint32) for r in rows[start:stop]]
            part_lengths = np.array([len(r) for r in part_rows], np.int64)
            tokens = np.concatenate(part_rows) if part_rows else np.zeros(0, np.uint32)
        offsets = np.zeros(stop - start + 1, np.int64)
        np.cumsum(part_lengths, out=offsets[1:])
        ids = (
            tuple(custom_ids[start:stop])
            if custom_ids is not None
            else tuple(f"item-{i}" for i in range(start, stop))
        )
        yield InputChunk(
            index=number,
            first_line=start + 1,
            last_line=stop,
            line=np.arange(start + 1, stop + 1, dtype=np.uint64),
            custom_ids=ids,
            models=(model,),
            model_index=np.zeros(stop - start, np.int64),
            shapes=(shape,),
            shape_index=np.zeros(stop - start, np.int64),
            tokens=tokens,
            offsets=offsets,
            text_items=np.zeros(0, np.int64),
            texts=(),
            errors=(),
        )
