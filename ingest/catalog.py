"""What input checking needs to know about the served models, built once from Settings.

For each `[[models]]` table: the endpoints it serves, whether it takes text
(it has a tokenizer), its prompt limit in tokens, the smaller of the
model's `max_tokens` and the largest lane, since an item that fits no lane
can never be stored, and its vocabulary size (`vocab_size`), so that a token
id the model cannot run is refused per line at ingest (`token_out_of_range`)
instead of reaching an engine:

| source of `vocab_size`                       | when                                  |
|----------------------------------------------|---------------------------------------|
| the model's `vocab_size`                     | set (> 0) in the configuration        |
| its tokenizer's size, added tokens included  | `tokenizer` is set and readable       |
| the engine's own (`ENGINE_VOCAB_SIZE`)       | an engine that fixes its model (minilm) |
| none: any id below 2**32                     | otherwise (echo, simulated; transformers and vllm without a tokenizer, whose engines turn an id beyond the model's vocabulary into that item's error) |

The broker sends the figure it resolved in its catalog (HELLO), and the
producer's SDK checks lines with it, so both refuse the same ids.

`models` holds every name a line may give in `body.model`: each model's
`name` and its `aliases`, all pointing at one entry, whose `name` is the
model's own (ingest/model_aliases.py names each chunk's models by it).

`logprobs` says whether the model's engine returns each generated token's
log probability (`LOGPROB_ENGINES`); a request that asks for them from any
other model is refused per line at ingest (`unsupported_parameter`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from config.defaults import ENDPOINTS, ENGINE_VOCAB_SIZE
from config.settings import ModelSettings
from config.stage_settings import Catalogued

EMBEDDINGS = "/v1/embeddings"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
# Engines that return per-token log probabilities (gpu/engines/transformers.py, vllm.py).
LOGPROB_ENGINES = frozenset({"transformers", "vllm"})


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model as input checking sees it."""

    name: str
    endpoints: frozenset[str]
    takes_text: bool
    prompt_limit_tokens: int
    vocab_size: int | None  # token ids are 0 .. vocab_size - 1; None: any uint32
    engine: str = ""
    logprobs: bool = False  # its engine returns per-token log probabilities


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    """The served models by name, the known endpoints, and the largest lane."""

    models: dict[str, ModelEntry]  # by name and by alias; entry.name is the model's own name
    endpoints: tuple[str, ...]
    largest_lane: int
    max_parts: int = 2048  # parts one line may fan out to (ingest.max_inputs_per_line)
    max_line_tokens: int = 1 << 20  # prompt tokens of one line's parts together

    @classmethod
    def from_settings(cls, settings: Catalogued) -> ModelCatalog:
        largest = settings.broker.lanes[-1]
        models = {}
        for model in settings.models:
            models.update(dict.fromkeys((model.name, *model.aliases), _entry(model, largest)))
        return cls(
            models=models,
            endpoints=ENDPOINTS,
            largest_lane=largest,
            max_parts=settings.ingest.max_inputs_per_line,
            max_line_tokens=settings.ingest.max_line_tokens,
        )

    def known_models(self) -> str:
        """The model names and aliases, comma-separated, for messages."""
        return ", ".join(sorted(self.models))


def prompt_limit_tokens(model: ModelSettings, largest_lane: int) -> int:
    """Longest prompt, in tokens, that `model` accepts and some lane can hold."""
    return min(model.max_tokens, largest_lane)


def vocab_size(model: ModelSettings) -> int | None:
    """The model's vocabulary size (see the module docstring), or None for no limit."""
    if model.vocab_size > 0:
        return model.vocab_size
    if model.tokenizer:
        size = _tokenizer_vocab_size(os.fspath(Path(model.tokenizer).expanduser().absolute()))
        if size is not None:
            return size
    return ENGINE_VOCAB_SIZE.get(model.engine)


@functools.lru_cache(maxsize=64)
def _tokenizer_vocab_size(path: str) -> int | None:
    """The size of a tokenizer.json's vocabulary with its added tokens; None if it cannot be
    read (the tokeniser stage, which needs the file, says why)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception:  # the tokenizers library raises bare Exception for a bad file
        return None


def _entry(model: ModelSettings, largest_lane: int) -> ModelEntry:
    return ModelEntry(
        name=model.name,
        endpoints=frozenset(model.endpoints),
        takes_text=bool(model.tokenizer),
        prompt_limit_tokens=prompt_limit_tokens(model, largest_lane),
        vocab_size=vocab_size(model),
        engine=model.engine,
        logprobs=model.engine in LOGPROB_ENGINES,
    )
