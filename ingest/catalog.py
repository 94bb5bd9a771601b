"""What input checking needs to know about the served models, built once from Settings.

For each `[[models]]` table: the endpoints it serves, whether it takes text
(it has a tokenizer) and its prompt limit in tokens, the smaller of the
model's `max_tokens` and the largest lane, since an item that fits no lane
can never be stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.defaults import ENDPOINTS
from config.settings import ModelSettings, Settings

EMBEDDINGS = "/v1/embeddings"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model as input checking sees it."""

    name: str
    endpoints: frozenset[str]
    takes_text: bool
    prompt_limit_tokens: int


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    """The served models by name, the known endpoints, and the largest lane."""

    models: dict[str, ModelEntry]
    endpoints: tuple[str, ...]
    largest_lane: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelCatalog:
        largest = settings.broker.lanes[-1]
        models = {m.name: _entry(m, largest) for m in settings.models}
        return cls(models=models, endpoints=ENDPOINTS, largest_lane=largest)

    def known_models(self) -> str:
        """The model names, comma-separated, for messages."""
        return ", ".join(sorted(self.models))


def prompt_limit_tokens(model: ModelSettings, largest_lane: int) -> int:
    """Longest prompt, in tokens, that `model` accepts and some lane can hold."""
    return min(model.max_tokens, largest_lane)


def _entry(model: ModelSettings, largest_lane: int) -> ModelEntry:
    return ModelEntry(
        name=model.name,
        endpoints=frozenset(model.endpoints),
        takes_text=bool(model.tokenizer),
        prompt_limit_tokens=prompt_limit_tokens(model, largest_lane),
    )
