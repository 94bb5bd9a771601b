"""The engine contract: what a worker runs a batch with. Load once, run batches, say which items failed.

Every engine in the registry keeps it; `tests/test_engine_contract.py` checks
it against each one (docs/engines.md, "The engine contract"). Invariant 14
tells the failures apart.

| | |
|---|---|
| life | `load()` once, in the worker process, before the first batch; then `run(batch)` per batch, on one thread |
| in | `EngineBatch`: `task` (EMBED or GENERATE), `tokens` uint32 `[n, lane]` zero padded on the right (often a non-contiguous view into the batch's slots: read, never write), `lengths` uint32 `[n]`, `max_tokens` (GENERATE's output budget), `shape` (a dict: temperature, top_p, seed, stop, stop_token_ids, top_logprobs; empty: greedy, no stop strings) |
| batch size | the worker asks for batches of about `target_batch_s` by the engine's measured speed, or full ones (`batch_items`, `batch_tokens`) for an engine whose `wants_full_batches` is True (it runs a batch's items together by itself: vLLM, an upstream server) |
| out | `EngineResult` with `len(errors) == n`, in the batch's order: `errors[i]` None or item i's own error (a non-empty str). EMBED: `embeddings` float32 `[n, dim]` (an errored item's row is zeros). GENERATE: `tokens` flat uint32 and `offsets` int64 `[n + 1]` from 0, non-decreasing, ending at `len(tokens)`; item i's ids are `tokens[offsets[i]:offsets[i + 1]]`, at most `max_tokens` of them, none for an errored item; with the shape's `top_logprobs` k, also `logprobs` float32 `[len(tokens)]` and `top_ids` uint32 / `top_logprobs` float32 `[len(tokens), k]` |
| item errors | an item of 0 tokens, one whose length passes its lane, one with an id outside the model's vocabulary, one too long for the model (prompt, plus `max_tokens` when generating) gets its own error; the other items of its batch run as if it were not there |
| the other task | a batch of a task the engine does not serve gets the same error for every item (an embed-only engine thus refuses stop strings, seeds and `max_tokens`) |
| sampling | greedy without a temperature; a seeded sampled item gives the same ids whatever shares its batch; stop strings end an item before the string's tokens |
| transient | `TransientEngineError`: the batch as a whole cannot run now (a restarting server, a quota); the worker hands it back without counting an attempt and backs off |
| out of memory | one rule for every engine, in `Engine.run`: a batch whose `infer` runs out of memory (`out_of_memory`) is split in two halves, each run the same way, and the outputs joined in order; when a single item runs out of memory alone, the batch is a `TransientEngineError`. Engines implement `infer`, never `run` |
| broken | anything else escaping `run`: the worker stops asking for work, hands back what it holds and exits, rather than retry against a dead engine |

Every engine module imports this one; none imports the registry
(`gpu/engines/registry.py`), which sits above them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pipeline.core.errors import FabricError

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


def out_of_memory(exc: BaseException | None) -> bool:
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


def piece(batch: EngineBatch, start: int, stop: int) -> EngineBatch:
    """Items `start:stop` of `batch` (views of its arrays), with its task, budget and shape."""
    return EngineBatch(
        batch.task,
        batch.tokens[start:stop],
        batch.lengths[start:stop],
        batch.max_tokens,
        batch.shape,
    )


def joined(parts: list[EngineResult]) -> EngineResult:
    """The results of consecutive pieces of one batch as that batch's one result."""

    def stacked(name: str) -> np.ndarray | None:
        arrays = [getattr(part, name) for part in parts]
        return None if any(a is None for a in arrays) else np.concatenate(arrays)

    offsets = None
    each = [part.offsets for part in parts]
    if all(o is not None for o in each):
        present = [o for o in each if o is not None]  # all of them: for the type checker
        bases = np.cumsum(np.array([0] + [int(o[-1]) for o in present[:-1]], np.int64))
        offsets = np.concatenate(
            [present[0][:1]] + [o[1:] + b for o, b in zip(present, bases, strict=True)]
        ).astype(np.int64)
    meta: dict = {}
    for part in parts:
        meta.update(part.meta)
    return EngineResult(
        [e for part in parts for e in part.errors],
        embeddings=stacked("embeddings"),
        tokens=stacked("tokens"),
        offsets=offsets,
        meta=meta,
        logprobs=stacked("logprobs"),
        top_ids=stacked("top_ids"),
        top_logprobs=stacked("top_logprobs"),
    )


class Engine:
    """Base class; see the module docstring for the contract.

    Subclasses implement `infer(batch)`; callers call `run(batch)`, which is
    `infer` under the out-of-memory rule (one rule for every engine).
    """

    name: ClassVar[str] = "engine"
    # True for an engine that runs a batch's items together by itself (vLLM's continuous
    # batching, the requests in flight to an upstream server): its speed grows with the items
    # a batch gives it, so the worker asks for full batches (`batch_items`, `batch_tokens`)
    # instead of sizing them to `target_batch_s` from its measured tokens/s (gpu/worker/session.py)
    wants_full_batches: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} overrides Engine.run; implement infer(batch) instead, so "
                "that the out-of-memory rule applies to it"
            )

    def load(self) -> None:
        """Load weights and warm up (once per process)."""

    def broken(self) -> str | None:
        """Why the engine can no longer finish what it runs (a process of its own died), or
        None; the worker's watchdog asks at each step. None by default."""
        return None

    def close(self) -> None:
        """Release what `load` started that outlives a process's exit on its own (vLLM's
        engine processes, request threads); the worker calls it as it ends. Nothing by
        default."""

    def figures(self) -> dict:
        """Numbers the engine reports through its worker (docs/metrics.md); none by default."""
        return {}

    def run(self, batch: EngineBatch) -> EngineResult:
        """`infer(batch)` under the out-of-memory rule: a batch that runs out of memory is split
        in halves until its pieces fit; when one item alone does not, a `TransientEngineError`
        (the worker hands the batch back without counting an attempt: invariant 14)."""
        try:
            return self._halved_on_oom(batch)
        except TransientEngineError:
            raise
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            alone = " (and for one item of it alone)" if len(batch.lengths) > 1 else ""
            raise TransientEngineError(
                f"{self.name} engine: out of memory for {batch_size_text(batch)}{alone} "
                f"({type(exc).__name__}: {exc}); the batch is handed back without counting an "
                "attempt"
            ) from exc

    def _halved_on_oom(self, batch: EngineBatch) -> EngineResult:
        """`infer(batch)`; out of memory with two items or more: each half so, joined."""
        n = len(batch.lengths)
        try:
            return self.infer(batch)
        except TransientEngineError:
            raise
        except Exception as exc:
            if n < 2 or not out_of_memory(exc):
                raise
        half = n // 2
        return joined(
            [self._halved_on_oom(piece(batch, 0, half)), self._halved_on_oom(piece(batch, half, n))]
        )

    def infer(self, batch: EngineBatch) -> EngineResult:
        """One output or one error per item, in order (see the module docstring)."""
        raise NotImplementedError
