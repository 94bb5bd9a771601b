"""The engine contract: what a worker runs a batch with. Load once, run batches, say which items failed.

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

Every engine module imports this one; none imports the registry
(`gpu/engines/registry.py`), which sits above them.
"""

from __future__ import annotations

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
    # With the shape's top_logprobs (k), per generated token (aligned with `tokens`): its log
    # probability (float32 [total]), and its k most likely ids and their log probabilities
    # (uint32 and float32 [total, k]); None when the shape asks for none.
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Per item, the prompt's tokens as the engine counted them (uint32 [n]; an upstream server's
    # usage.prompt_tokens); None: the prompt's length as sent.
    prompt_tokens: np.ndarray | None = None


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

    def figures(self) -> dict:
        """Numbers the engine reports through its worker (docs/metrics.md); none by default."""
        return {}

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
