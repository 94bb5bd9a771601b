"""What every generation engine shares: sampling from the shape, per-item checks, stop strings, packing.

The `transformers` and `vllm` engines both read a batch's sampling
parameters with `Sampling.of`, refuse bad items with `item_errors` before the
model sees them, cut stop strings with `kept_before_stop`, and pack their
per-item outputs with `pack`, so that both return the same ids for the same
request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.engines.base import EngineBatch, EngineResult
from gpu.engines.logprobs import pack_logprobs


@dataclass(frozen=True)
class Sampling:
    """How one batch decodes: the shape's sampling parameters (all items of a batch share them)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of(cls, batch: EngineBatch) -> Sampling:
        """The batch's sampling parameters from its shape dict; greedy when it has none."""
        shape: dict[str, Any] = getattr(batch, "shape", None) or {}
        stop = shape.get("stop") or ()
        return cls(
            temperature=float(shape.get("temperature") or 0.0),
            top_p=float(shape.get("top_p") or 1.0),
            seed=shape.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(int(t) for t in shape.get("stop_token_ids") or ()),
        )


def kept_before_stop(tokens: Sequence[int], stops: Sequence[str], decode) -> int:
    """How many of `tokens` to keep: all, or those whose text ends before the first stop string.

    `decode(ids) -> str`. When a stop string begins inside a token, that token
    goes too (the output is token ids; a token is never cut).
    """
    if not stops or not len(tokens):
        return len(tokens)
    text = decode(list(tokens))
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if not found:
        return len(tokens)
    before = text[: min(found)]
    for keep in range(len(tokens), -1, -1):  # generation stopped at the stop string: few steps
        if before.startswith(decode(list(tokens[:keep]))):
            return keep
    return 0


def pack(outputs: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per-item outputs (None for an item with an error) -> flat uint32 tokens and int64 offsets."""
    sizes = np.fromiter((0 if o is None else len(o) for o in outputs), np.int64, len(outputs))
    offsets = np.zeros(len(outputs) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    parts = [o for o in outputs if o is not None and len(o)]
    flat = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    return flat, offsets


def generated_result(
    errors: Any, outputs: list[np.ndarray | None], scored: list, top: int | None
) -> EngineResult:
    """A generation engine's result: the packed outputs, and their log probabilities (the
    `top` alternatives per token) when the batch asked for them (`top` not None)."""
    tokens, offsets = pack(outputs)
    if top is None:
        return EngineResult(errors, tokens=tokens, offsets=offsets)
    logprobs, top_ids, top_logprobs = pack_logprobs(scored, top)
    return EngineResult(
        errors,
        tokens=tokens,
        offsets=offsets,
        logprobs=logprobs,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def item_errors(
    batch: EngineBatch, vocab_size: int, context_tokens: int, engine: str
) -> list[str | None]:
    """Per item: why it cannot run on this model, or None. Vectorised over the batch.

    An embed batch passes `max_tokens` 0 (it generates nothing)."""
    lengths = batch.lengths.astype(np.int64)
    lane = batch.tokens.shape[1]
    inside = np.arange(lane)[None, :] < np.minimum(lengths, lane)[:, None]
    top = np.where(inside, batch.tokens, 0).max(axis=1, initial=0).astype(np.int64)
    errors: list[str | None] = [None] * len(lengths)
    bad = (lengths == 0) | (lengths > lane) | (top >= vocab_size)
    bad |= lengths + batch.max_tokens > context_tokens
    for i in np.flatnonzero(bad).tolist():
        n = int(lengths[i])
        if n == 0:
            errors[i] = f"input has no tokens; engine {engine} needs at least one"
        elif n > lane:
            errors[i] = f"input says {n} tokens but its batch lane holds {lane}"
        elif top[i] >= vocab_size:
            errors[i] = (
                f"token id {int(top[i])} is outside the model's vocabulary of {vocab_size} ids; "
                "send ids from this model's tokenizer"
            )
        else:
            errors[i] = (
                f"input of {n} tokens plus max_tokens {batch.max_tokens} passes the model's "
                f"context of {context_tokens} tokens; shorten the prompt or lower max_tokens"
            )
    return errors


def wrong_task(batch: EngineBatch, engine: str) -> EngineResult:
    """Every item's error for an embed batch sent to a generation engine."""
    n = len(batch.lengths)
    error = (
        f"model on engine {engine} only generates; task {batch.task!r} is not served: send this "
        "model /v1/chat/completions or /v1/completions requests"
    )
    return EngineResult(
        [error] * n, tokens=np.zeros(0, np.uint32), offsets=np.zeros(n + 1, np.int64)
    )
