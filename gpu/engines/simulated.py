"""The `simulated` engine: spends `tokens / tokens_per_s` seconds per batch and returns
deterministic outputs (a stand-in for a GPU in benchmarks)."""

from __future__ import annotations

import time
from typing import ClassVar

import numpy as np

from gpu.engines.base import EMBED, GENERATE, Engine, EngineBatch, EngineError, EngineResult
from gpu.engines.echo import ANY_ID, NO_CONTEXT_LIMIT
from gpu.engines.generation import item_errors


class SimulatedEngine(Engine):
    """Takes the time a GPU at `tokens_per_s` would, and returns stable outputs.

    Like `echo` it has no model (any id, any length; the shape changes nothing), and an item of
    0 tokens, or whose length passes its lane, gets its own error."""

    name = "simulated"
    dim: ClassVar[int] = 384

    def __init__(self, tokens_per_s: float = 50_000.0, sleep=time.sleep) -> None:
        if tokens_per_s <= 0:
            raise EngineError(f"simulated engine: tokens_per_s = {tokens_per_s} must be > 0")
        self.tokens_per_s = tokens_per_s
        self._sleep = sleep

    def infer(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        work = int(batch.lengths.sum()) + (n * batch.max_tokens if batch.task == GENERATE else 0)
        self._sleep(work / self.tokens_per_s)
        errors = item_errors(batch, ANY_ID, NO_CONTEXT_LIMIT, self.name)
        served = np.array([e is None for e in errors], bool)
        seeds = (batch.tokens.astype(np.uint64) * np.uint64(0x9E3779B1)).sum(axis=1)
        if batch.task == EMBED:
            base = np.arange(self.dim, dtype=np.uint64)[None, :] * np.uint64(2654435761)
            raw = ((seeds[:, None] + base) % np.uint64(1 << 16)).astype(np.float32) - 32768.0
            vectors = raw / np.linalg.norm(raw, axis=1, keepdims=True)
            vectors[~served] = 0.0
            return EngineResult(errors, embeddings=vectors.astype(np.float32))
        out = (seeds[:, None] + np.arange(batch.max_tokens, dtype=np.uint64)[None, :]) % np.uint64(
            30_000
        )
        sizes = np.where(served, batch.max_tokens, 0)
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        return EngineResult(
            errors, tokens=out[served].astype(np.uint32).reshape(-1), offsets=offsets
        )
