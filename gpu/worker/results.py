"""The RESULTS arrays a worker sends for one batch (docs/wire.md, RESULTS).

| array           | dtype | per item                                                   |
|-----------------|-------|------------------------------------------------------------|
| `items`         | `ITEM_DTYPE` | the item (gpu/work_protocol.py)                     |
| `status`        | u1    | `ResultStatus`: RESULT, or ERROR for an item's own error   |
| `kind`          | u1    | `ResultKind`: VECTOR (f32), TOKENS (u32), TOKEN_LOGPROBS (pipeline/core/token_logprobs.py), or TEXT (an error) |
| `prompt_tokens` | u4    | the prompt's length (or the engine's count: an upstream's usage) |
| `payload`       | u1    | every item's bytes, back to back                           |
| `offsets`       | i8    | `n + 1` byte offsets into `payload`                        |
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from gpu.engines.base import EngineResult
from pipeline.core import token_logprobs
from pipeline.core.result_kinds import ResultKind, ResultStatus


def results_message(items: np.ndarray, lengths: np.ndarray, result: EngineResult) -> dict:
    """The RESULTS arrays for one batch: status, kind, prompt tokens and payload per item."""
    n = len(items)
    errors = result.errors
    status = np.full(n, ResultStatus.RESULT, np.uint8)
    if result.embeddings is not None:
        vectors = np.ascontiguousarray(result.embeddings, dtype="<f4")
        kind = np.full(n, ResultKind.VECTOR, np.uint8)
        payload = vectors.view(np.uint8).reshape(-1)
        offsets = np.arange(n + 1, dtype=np.int64) * vectors.shape[1] * 4
    elif result.logprobs is not None:
        kind = np.full(n, ResultKind.TOKEN_LOGPROBS, np.uint8)
        payload, offsets = _with_logprobs(result)
    else:
        tokens = np.ascontiguousarray(result.tokens, dtype="<u4")
        kind = np.full(n, ResultKind.TOKENS, np.uint8)
        payload = tokens.view(np.uint8)
        offsets = np.asarray(result.offsets, np.int64) * 4
    if any(e is not None for e in errors):
        parts = []
        sizes = []
        for i, error in enumerate(errors):
            if error is None:
                part = payload[offsets[i] : offsets[i + 1]].tobytes()
            else:
                part = error.encode("utf-8")
                status[i], kind[i] = ResultStatus.ERROR, ResultKind.TEXT
            parts.append(part)
            sizes.append(len(part))
        payload = np.frombuffer(b"".join(parts), np.uint8)
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return {
        "items": items,
        "status": status,
        "kind": kind,
        "prompt_tokens": (lengths if result.prompt_tokens is None else result.prompt_tokens).astype(
            np.uint32
        ),
        "payload": payload,
        "offsets": offsets,
    }


def _with_logprobs(result: EngineResult) -> tuple[np.ndarray, np.ndarray]:
    """Every item's TOKEN_LOGPROBS payload back to back, and their byte offsets."""
    bounds = np.asarray(result.offsets, np.int64).tolist()
    parts = [
        token_logprobs.pack(
            result.tokens[a:b], result.logprobs[a:b], result.top_ids[a:b], result.top_logprobs[a:b]
        )
        for a, b in pairwise(bounds)
    ]
    sizes = np.fromiter(map(len, parts), np.int64, len(parts))
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return np.frombuffer(b"".join(parts), np.uint8), offsets


def keep_results(arrays: dict, keep: np.ndarray) -> dict:
    """The RESULTS arrays of `results_message` for the items where `keep` is True only."""
    offsets = arrays["offsets"]
    starts, ends = offsets[:-1][keep], offsets[1:][keep]
    sizes = ends - starts
    index = np.repeat(starts - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes) + np.arange(
        int(sizes.sum())
    )
    return {
        "items": arrays["items"][keep],
        "status": arrays["status"][keep],
        "kind": arrays["kind"][keep],
        "prompt_tokens": arrays["prompt_tokens"][keep],
        "payload": arrays["payload"][index],
        "offsets": np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
    }
