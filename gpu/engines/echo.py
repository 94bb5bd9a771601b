"""The `echo` engine, for tests: generation returns the prompt's tokens, embedding returns them as floats.

Three environment variables make it fail as a GPU engine can (for fault tests):

| variable             | value     | a batch with an item whose first token is that value |
|----------------------|-----------|------------------------------------------------------|
| `FABRIC_ECHO_POISON` | TOKEN     | kills the worker process with SIGKILL (a crashing kernel) |
| `FABRIC_ECHO_HANG`   | TOKEN     | never ends (a hung kernel: only `batch_timeout_s` ends it) |
| `FABRIC_ECHO_OOM`    | TOKEN:N   | raises torch's out-of-memory error, the first N times in this process (each halved piece that holds such an item counts: `Engine.run`) |
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from gpu.engines.base import EMBED, Engine, EngineBatch, EngineResult
from gpu.engines.generation import item_errors

POISON_ENV = "FABRIC_ECHO_POISON"
HANG_ENV = "FABRIC_ECHO_HANG"  # tests: a batch with an item starting with this token never ends
OOM_ENV = "FABRIC_ECHO_OOM"  # tests: "TOKEN:N": such a batch runs out of memory N times
ANY_ID = 1 << 32  # no vocabulary: every uint32 id is served
NO_CONTEXT_LIMIT = 1 << 62


class EchoEngine(Engine):
    """Generation echoes the prompt (cut to max_tokens); embedding returns the tokens as floats.

    It has no model: any id is served, at any length, and the shape (sampling, stop strings)
    does not change its output. An item of 0 tokens, or whose length passes its lane, gets its
    own error, as in every engine.

    For fault tests, `poison_token` (or the FABRIC_ECHO_POISON environment
    variable) names a token: a batch with an item that starts with it kills
    the worker process with SIGKILL, as a crashing GPU kernel would.
    FABRIC_ECHO_HANG names a token whose batch never ends (a hung kernel), and
    FABRIC_ECHO_OOM = "TOKEN:N" one whose batch raises torch's out-of-memory
    error the first N times this process runs one.
    """

    name = "echo"

    def __init__(self, poison_token: int | None = None) -> None:
        if poison_token is None and os.environ.get(POISON_ENV):
            poison_token = int(os.environ[POISON_ENV])
        self.poison_token = poison_token
        token, _, times = os.environ.get(OOM_ENV, "").partition(":")
        self.oom_token = int(token) if token else None
        self.oom_left = int(times or 1)

    def infer(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        if self.poison_token is not None and n and (batch.tokens[:, 0] == self.poison_token).any():
            os.kill(os.getpid(), signal.SIGKILL)
        hang = os.environ.get(HANG_ENV)
        if hang and n and (batch.tokens[:, 0] == int(hang)).any():
            while True:  # a hung kernel: only the worker's batch_timeout_s ends it
                time.sleep(3600)
        if self.oom_left > 0 and n and (batch.tokens[:, 0] == self.oom_token).any():
            self.oom_left -= 1
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (echo, a test)")
        errors = item_errors(batch, ANY_ID, NO_CONTEXT_LIMIT, self.name)
        served = np.array([e is None for e in errors], bool)
        if batch.task == EMBED:
            vectors = batch.tokens.astype(np.float32)
            vectors[~served] = 0.0
            return EngineResult(errors, embeddings=vectors)
        lengths = np.where(served, np.minimum(batch.lengths.astype(np.int64), batch.max_tokens), 0)
        keep = np.arange(batch.tokens.shape[1])[None, :] < lengths[:, None]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return EngineResult(errors, tokens=batch.tokens[keep].astype(np.uint32), offsets=offsets)
