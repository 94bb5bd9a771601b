"""The payload of a `TOKEN_LOGPROBS` result: generated tokens with their log probabilities.

One home for its layout, used by the worker (which packs it), completion
(which checks and counts it) and delivery (which renders it). All values
little-endian, 4 bytes each, so the payload is a whole number of u4 words:

| words         | type | content                                                  |
|---------------|------|----------------------------------------------------------|
| 0             | u4   | m: generated tokens                                      |
| 1             | u4   | k: alternatives per token (the shape's `top_logprobs`)   |
| 2 .. 2+m      | u4   | the generated token ids (what a `TOKENS` payload holds)  |
| m words       | f4   | each token's log probability                             |
| m*k words     | u4   | per token, its k most likely token ids, most likely first |
| m*k words     | f4   | their log probabilities                                  |

So a payload is `4 * (2 + m * (2 + 2 * k))` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEADER_WORDS = 2


def payload_words(m: int, k: int) -> int:
    """The payload's length in 4-byte words for m tokens with k alternatives each."""
    return HEADER_WORDS + m * (2 + 2 * k)


def pack(
    tokens: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> bytes:
    """One item's payload: m tokens, their log probabilities, and [m, k] alternatives."""
    m = len(tokens)
    k = top_ids.shape[1] if top_ids.ndim == 2 else 0
    words = np.empty(payload_words(m, k), "<u4")
    words[:HEADER_WORDS] = (m, k)
    at = HEADER_WORDS
    words[at : at + m] = tokens
    at += m
    words[at : at + m] = np.asarray(logprobs, "<f4").view("<u4")
    at += m
    words[at : at + m * k] = np.asarray(top_ids, "<u4").reshape(-1)
    at += m * k
    words[at:] = np.asarray(top_logprobs, "<f4").reshape(-1).view("<u4")
    return words.tobytes()


def headers(payload: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, k) of the payloads starting at byte `starts` of `payload` (each at least 8 bytes)."""
    buffer = np.ascontiguousarray(payload, dtype=np.uint8)
    at = np.asarray(starts, np.int64)[:, None] + np.arange(8)[None, :]
    words = np.ascontiguousarray(buffer[at]).view("<u4").reshape(-1, 2).astype(np.int64)
    return words[:, 0], words[:, 1]


@dataclass(frozen=True)
class TokenLogprobs:
    """One unpacked payload."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]  # per token, k ids
    top_logprobs: list[list[float]]


def unpack(words: np.ndarray) -> TokenLogprobs:
    """A payload (its u4 words, checked by completion) unpacked."""
    words = np.asarray(words, "<u4")
    m, k = int(words[0]), int(words[1])
    at = HEADER_WORDS
    tokens = words[at : at + m]
    logprobs = words[at + m : at + 2 * m].view("<f4")
    at += 2 * m
    top_ids = words[at : at + m * k].reshape(m, k)
    top_logprobs = words[at + m * k : at + 2 * m * k].view("<f4").reshape(m, k)
    return TokenLogprobs(
        tokens.tolist(),
        logprobs.astype(np.float64).tolist(),
        top_ids.tolist(),
        top_logprobs.astype(np.float64).tolist(),
    )
