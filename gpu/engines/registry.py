"""The engines by name: `make_engine(name, **options)`.

The registry sits above the engine modules: it imports them (the heavy ones
only when selected, so that onnxruntime, torch or vLLM load only where they
run); no engine module imports it.

| name           | module                        | needs                          |
|----------------|-------------------------------|--------------------------------|
| `echo`         | `gpu/engines/echo.py`         | nothing (tests)                |
| `simulated`    | `gpu/engines/simulated.py`    | nothing (benchmarks)           |
| `minilm`       | `gpu/engines/minilm.py`       | onnxruntime, the pinned model  |
| `transformers` | `gpu/engines/transformers.py` | torch, transformers            |
| `vllm`         | `gpu/engines/vllm.py`         | vLLM (GPU, or its CPU build)   |
| `openai`       | `gpu/engines/openai.py`       | an OpenAI-compatible server    |
"""

from __future__ import annotations

from collections.abc import Callable

from gpu.engines.base import Engine, EngineError
from gpu.engines.echo import EchoEngine
from gpu.engines.simulated import SimulatedEngine


class EngineOptionsError(EngineError):
    """An engine was given options it does not take."""


def _minilm(**options) -> Engine:
    from gpu.engines.minilm import MiniLMEngine  # onnxruntime loads only when selected

    return MiniLMEngine(**options)


def _transformers(**options) -> Engine:
    from gpu.engines.transformers import TransformersEngine  # torch loads only when selected

    return TransformersEngine(**options)


def _vllm(**options) -> Engine:
    from gpu.engines.vllm import VllmEngine  # vllm loads only when selected

    return VllmEngine(**options)


def _openai(**options) -> Engine:
    from gpu.engines.openai import OpenAIEngine

    return OpenAIEngine(**options)


ENGINES: dict[str, Callable[..., Engine]] = {
    "echo": EchoEngine,
    "simulated": SimulatedEngine,
    "minilm": _minilm,
    "transformers": _transformers,
    "vllm": _vllm,
    "openai": _openai,
}


def make_engine(name: str, **options) -> Engine:
    """The engine called `name`; EngineError naming the known ones otherwise."""
    try:
        cls = ENGINES[name]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise EngineError(
            f"engine {name!r} is not available here; known engines: {known}"
        ) from None
    try:
        return cls(**options)
    except TypeError as exc:  # an option it does not take, or a value of the wrong type
        raise EngineOptionsError(
            f"engine {name!r} does not take options {options} ({exc}); see docs/engines.md "
            "for its options"
        ) from None
