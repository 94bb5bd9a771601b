"""How the completion log stores one result: a slot's flags word and body.

A job's results live in completion segments (the input log's segment format,
kind 2, keyed by the job id and a size class). In each slot:

| field | content |
|-------|---------|
| seq, job, index | the item (pipeline/core/item_seq.py) |
| count | stored bytes: `PROMPT_HEADER` + payload |
| body  | `[u32 prompt tokens][payload]`, zero padded |
| flags | `status \\| kind << 4 \\| model << 8 \\| shape << 16` (below) |
| marker | LIVE = stored, not delivered; DEAD = delivered (invariant 12) |

| flags bits | field  | values |
|------------|--------|--------|
| 0-3        | status | `ResultStatus` (pipeline/core/result_kinds.py) |
| 4-7        | kind   | `ResultKind` |
| 8-15       | model  | the input's model, its id in `<data_dir>/models.log` (0 = unknown; above 255 stored as 255) |
| 16-31      | shape  | the input's shape id (0 = none; above 65535 stored as 65535) |

A result goes to the smallest of `SIZE_CLASSES` (stored bytes) that holds
it; one larger than the largest is stored as an error result saying so.
"""

from __future__ import annotations

import numpy as np

from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.core.result_kinds import ResultKind, ResultStatus

PROMPT_HEADER = 4
SIZE_CLASSES = (256, 1024, 4096, 16384, 65536, 262144, 1 << 20)  # stored bytes per result
# A job's completion segment of one size class: the first holds FIRST_SEGMENT_BYTES' worth of
# slots or the items the job still expects (if more), the next twice the last, up to
# segment_bytes. A small job gets a small file; a large one reaches full size.
FIRST_SEGMENT_BYTES = 256 * 1024
STATUS_MASK = 0x0F
MODELS_FILE = "models.log"
TOO_LARGE = f"{ItemErrorCode.RESULT_TOO_LARGE}: the output exceeds the largest result slot".encode()


def flags_of(status, kind, model=0, shape=0) -> np.ndarray:
    """The flags word of stored results (numpy arrays or scalars)."""
    return (
        np.asarray(status, np.uint32)
        | (np.asarray(kind, np.uint32) << np.uint32(4))
        | (np.minimum(np.asarray(model, np.uint32), 0xFF) << np.uint32(8))
        | (np.minimum(np.asarray(shape, np.uint32), 0xFFFF) << np.uint32(16))
    )


def status_of(flags: np.ndarray) -> np.ndarray:
    return (flags & np.uint32(STATUS_MASK)).astype(np.uint8)


def split_flags(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(status u1, kind u1, model u1, shape u2) of each flags word."""
    return (
        status_of(flags),
        ((flags >> 4) & 0x0F).astype(np.uint8),
        ((flags >> 8) & 0xFF).astype(np.uint8),
        (flags >> 16).astype(np.uint16),
    )


def result_tokens(
    flags: np.ndarray, prompt: np.ndarray, payload_bytes: np.ndarray, first_word: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, generated tokens) per stored result: both 0 for an error result; the
    generated tokens are the payload's u4 words for a TOKENS result, its first word (m,
    pipeline/core/token_logprobs.py) for a TOKEN_LOGPROBS one, 0 for any other kind."""
    status, kind, _, _ = split_flags(np.asarray(flags, np.uint32))
    ok = status == ResultStatus.RESULT
    prompt = np.where(ok, np.asarray(prompt, np.int64), 0)
    generated = np.where(ok & (kind == ResultKind.TOKENS), np.asarray(payload_bytes) // 4, 0)
    logprobs = ok & (kind == ResultKind.TOKEN_LOGPROBS)
    generated = np.where(logprobs, np.asarray(first_word, np.int64), generated)
    return prompt, generated


def first_words(payload: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The first u4 word of each payload (0 for one shorter than 4 bytes)."""
    buffer = np.ascontiguousarray(payload, dtype=np.uint8)
    whole = np.asarray(sizes) >= 4
    at = np.where(whole, np.asarray(starts, np.int64), 0)[:, None] + np.arange(4)[None, :]
    if not len(buffer):
        return np.zeros(len(at), np.int64)
    words = np.ascontiguousarray(buffer[np.minimum(at, len(buffer) - 1)]).view("<u4")
    return np.where(whole, words.reshape(-1).astype(np.int64), 0)
