"""The `echo` engine, for tests: generation returns the prompt's tokens, embedding returns them as floats.

Four engine options make it fail as a GPU engine can, for fault tests. A test's config
passes them (`[workers] options = {poison_token = 666}`, or `run.py worker --option
poison_token=666`); the engine reads nothing else:

| option                     | a batch with an item whose first token is that value |
|----------------------------|------------------------------------------------------|
| `poison_token`             | kills the worker process with SIGKILL (a crashing kernel) |
| `hang_token`               | never ends (a hung kernel: only `batch_timeout_s` ends it) |
| `refuse_token`             | that item (only it) gets its own error, as a model refuses an input it cannot serve |
| `oom_token` (`oom_times`)  | raises torch's out-of-memory error, the first `oom_times` (default 1) times in this process (each halved piece that holds such an item counts: `Engine.run`) |
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from gpu.engines.base import EMBED, Engine, EngineBatch, EngineResult
from gpu.engines.generation import item_errors

ANY_ID = 1 << 32  # no vocabulary: every uint32 id is served
NO_CONTEXT_LIMIT = 1 << 62


class EchoEngine(Engine):
    """Generation echoes the prompt (cut to max_tokens); embedding returns the tokens as floats.

    It has no model: any id is served, at any length, and the shape (sampling, stop strings)
    does not change its output. An item of 0 tokens, or whose length passes its lane, gets its
    own error, as in every engine.

    For fault tests (the module docstring's table), `poison_token` names a token: a batch
    with an item that starts with it kills the worker process with SIGKILL, as a crashing
    GPU kernel would. `hang_token` names one whose batch never ends (a hung kernel), and
    `oom_token` one whose batch raises torch's out-of-memory error the first `oom_times`
    times this process runs one. `refuse_token` names one whose item alone gets its own
    error (the batch runs).
    """

    name = "echo"

    def __init__(
        self,
        poison_token: int | None = None,
        hang_token: int | None = None,
        oom_token: int | None = None,
        oom_times: int = 1,
        refuse_token: int | None = None,
    ) -> None:
        self.poison_token = poison_token
        self.hang_token = hang_token
        self.oom_token = oom_token
        self.oom_left = oom_times if oom_token is not None else 0
        self.refuse_token = refuse_token

    def infer(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        if self.poison_token is not None and n and (batch.tokens[:, 0] == self.poison_token).any():
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang_token is not None and n and (batch.tokens[:, 0] == self.hang_token).any():
            while True:  # a hung kernel: only the worker's batch_timeout_s ends it
                time.sleep(3600)
        if self.oom_left > 0 and n and (batch.tokens[:, 0] == self.oom_token).any():
            self.oom_left -= 1
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (echo, a test)")
        errors = item_errors(batch, ANY_ID, NO_CONTEXT_LIMIT, self.name)
        if self.refuse_token is not None and n:
            for i in np.flatnonzero(batch.tokens[:, 0] == self.refuse_token).tolist():
                errors[i] = errors[i] or f"echo refuses items starting with {self.refuse_token}"
        served = np.array([e is None for e in errors], bool)
        if batch.task == EMBED:
            vectors = batch.tokens.astype(np.float32)
            vectors[~served] = 0.0
            return EngineResult(errors, embeddings=vectors)
        lengths = np.where(served, np.minimum(batch.lengths.astype(np.int64), batch.max_tokens), 0)
        keep = np.arange(batch.tokens.shape[1])[None, :] < lengths[:, None]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return EngineResult(errors, tokens=batch.tokens[keep].astype(np.uint32), offsets=offsets)
