"""`GET /v1/models` and `GET /v1/models/{id}`: what this broker serves, as OpenAI lists models.

Every OpenAI-compatible server answers these, and clients ask them to learn
what to write in `body.model` (`client.models.list()`). Each `[[models]]`
`name` and each of its `aliases` is one Model object, in configuration order:

    {"id": NAME, "object": "model", "created": T, "owned_by": "inference-fabric", "root": MODEL}

`root` (as vLLM writes it) is the model's own name: the `id` itself for the
model, the model's name for an alias. `created` is when this API process
started serving (a configuration has no creation time to give). The list is
`{"object": "list", "data": [...]}`. An id may hold '/', written as it is
(`/v1/models/meta-llama/Llama-3.1-8B-Instruct`) or as `%2F` (what the openai
client sends); an id not served answers 404 with OpenAI's error body. Both
routes take the same bearer keys as every other (api/keys.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from api.errors import ApiError
from config.stage_settings import Modelled

OWNED_BY = "inference-fabric"


def model_objects(settings: Modelled, created: int) -> list[dict[str, Any]]:
    """One OpenAI Model object per served name: each model's own, then its aliases."""
    return [
        {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY, "root": m.name}
        for m in settings.models
        for name in (m.name, *m.aliases)
    ]


def add_models_routes(app: FastAPI, settings: Modelled, owner_of: Callable[[Request], str]) -> None:
    """Serve the two routes on `app`; `owner_of` checks the caller's key (401 if refused)."""
    objects = model_objects(settings, int(time.time()))
    by_id = {o["id"]: o for o in objects}

    @app.get("/v1/models")
    def list_models(request: Request) -> dict:
        owner_of(request)
        return {"object": "list", "data": objects}

    @app.get("/v1/models/{model_id:path}")
    def get_model(request: Request, model_id: str) -> dict:
        owner_of(request)
        found = by_id.get(model_id)
        if found is None:
            raise ApiError(
                404,
                f"The model '{model_id}' does not exist: this server serves {', '.join(by_id)}",
                param="model",
                code="model_not_found",
            )
        return found
