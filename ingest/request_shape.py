"""The shape of a request: every body parameter besides the prompt that a GPU batch shares.

A `Shape` is canonical: parameters a line leaves out (or sets to null) take
the defaults below, numbers are normalised (`1` and `1.0` are one
temperature), and parameters an endpoint does not use are None, so two lines
that mean the same thing get equal, equally hashed shapes. The router maps
each distinct `Shape` to an id in the shape table; items carry only that id.

| parameter     | endpoints          | default | accepted                                   |
|---------------|--------------------|---------|--------------------------------------------|
| `max_tokens`  | completions, chat  | 256     | integer 1 .. 1048576 (output budget)       |
| `temperature` | completions, chat  | 1.0     | number 0 .. 2                              |
| `top_p`       | completions, chat  | 1.0     | number > 0 and <= 1                        |
| `seed`        | completions, chat  | none    | integer 0 .. 2**63 - 1                     |
| `stop`        | completions, chat  | none    | a string, or a list of 1 .. 4 strings      |
| `priority`    | all                | 0       | integer 0 .. 9; higher is served first     |
| `encoding_format` | embeddings     | "float" | "float" or "base64" (how delivery writes the vector) |
| `logprobs`    | chat               | false   | true: each generated token's log probability |
| `top_logprobs`| chat               | 0       | integer 0 .. 20: the most likely alternatives per token (turns `logprobs` on) |
| `logprobs`    | completions        | none    | integer 0 .. 5: log probabilities with that many alternatives per token |
| `top_logprobs`| responses          | none    | integer 0 .. 20: log probabilities with that many alternatives per token |
| `include`     | responses          | none    | a list holding `"message.output_text.logprobs"`: log probabilities (0 alternatives unless `top_logprobs` says more) |

Chat also takes `max_completion_tokens` as another name for `max_tokens`
(not both); `/v1/responses` takes `max_output_tokens` for it, and only
`temperature`, `top_p` and `priority` besides. Embeddings take only
`priority` and `encoding_format`. Logprobs are one shape field,
`top_logprobs`: None when not asked for, else the number of alternatives
(chat's `logprobs: true` alone is 0, as is a responses `include` of
`message.output_text.logprobs` alone; a stored shape carries `top_logprobs`
alone, which is why `top_logprobs` without `logprobs` or `include` turns them
on, where OpenAI would refuse it or give none). `encoding_format` changes only how
delivery renders the vector, but it is part of the shape because the shape
table is what delivery reads per item; `None` (float) is left out of
`as_dict()`, so shapes stored before the field existed keep their ids; so is
`top_logprobs` None.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

from ingest.catalog import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from ingest.line_errors import (
    CONFLICTING_FIELDS,
    INVALID_VALUE,
    UNSUPPORTED_PARAMETER,
    WRONG_TYPE,
    Rejected,
    show,
)

DEFAULT_MAX_TOKENS: Final = 256
MAX_OUTPUT_TOKENS: Final = 1 << 20
DEFAULT_TEMPERATURE: Final = 1.0
DEFAULT_TOP_P: Final = 1.0
DEFAULT_PRIORITY: Final = 0
MAX_PRIORITY: Final = 9
MAX_SEED: Final = 2**63 - 1
MAX_STOP_SEQUENCES: Final = 4
ENCODING_FORMATS: Final = ("float", "base64")
MAX_TOP_LOGPROBS: Final = {CHAT_COMPLETIONS: 20, "/v1/completions": 5, RESPONSES: 20}
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"  # the one `include` served

# Body keys that are shape parameters, per endpoint.
GENERATE_PARAMETERS: Final = ("max_tokens", "temperature", "top_p", "seed", "stop", "priority")
SHAPE_PARAMETERS: Final[dict[str, tuple[str, ...]]] = {
    EMBEDDINGS: ("priority", "encoding_format"),
    CHAT_COMPLETIONS: (*GENERATE_PARAMETERS, "max_completion_tokens", "logprobs", "top_logprobs"),
    "/v1/completions": (*GENERATE_PARAMETERS, "logprobs"),
    RESPONSES: ("max_output_tokens", "temperature", "top_p", "priority", "top_logprobs", "include"),
}


@dataclass(frozen=True, slots=True)
class Shape:
    """Canonical shape parameters of one request; hashable, equal when they mean the same."""

    endpoint: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    priority: int
    encoding_format: str | None = None  # embeddings: "base64", or None for float
    top_logprobs: int | None = None  # generation: alternatives per token; None: no logprobs

    @property
    def task(self) -> str:
        """'embed' for /v1/embeddings, 'generate' for the completion endpoints."""
        return "embed" if self.endpoint == EMBEDDINGS else "generate"

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (stop as a list) for the shape table and for JSON."""
        values = asdict(self)
        values["stop"] = list(self.stop)
        for key in ("encoding_format", "top_logprobs"):
            if values[key] is None:
                del values[key]  # the shapes stored before the field existed keep their ids
        return values


def parse_shape(body: Mapping[str, Any], endpoint: str) -> Shape:
    """The canonical shape of `body` sent to `endpoint`; raise Rejected naming a bad parameter.

    The caller has already refused keys that `endpoint` does not take.
    """
    priority = _integer(body, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
    if endpoint == EMBEDDINGS:
        return _embedding_shape(priority, _encoding(body))
    if endpoint == RESPONSES and body.get("max_output_tokens") is not None:
        name = "max_output_tokens"  # from a request body; a stored shape says max_tokens
    elif "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        if body.get("max_tokens") is not None:
            raise Rejected(
                CONFLICTING_FIELDS,
                "body sets both max_tokens and max_completion_tokens; they are one "
                "parameter: keep one of them",
            )
        name = "max_completion_tokens"
    else:
        name = "max_tokens"
    return Shape(
        endpoint=endpoint,
        max_tokens=_integer(body, name, DEFAULT_MAX_TOKENS, 1, MAX_OUTPUT_TOKENS),
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0, low_open=False),
        top_p=_number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0, low_open=True),
        seed=_integer(body, "seed", None, 0, MAX_SEED),
        stop=_stop(body.get("stop")),
        priority=priority,
        top_logprobs=_logprobs(body, endpoint),
    )


@functools.lru_cache(maxsize=64)
def _embedding_shape(priority: int, encoding_format: str | None) -> Shape:
    """One shared Shape per embeddings (priority, encoding): not built again for every line."""
    return Shape(EMBEDDINGS, None, None, None, None, (), priority, encoding_format)


def _logprobs(body: Mapping[str, Any], endpoint: str) -> int | None:
    """The shape's `top_logprobs` (see the module docstring): None for no logprobs."""
    if endpoint not in MAX_TOP_LOGPROBS:
        return None
    most = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == RESPONSES:
        asked = _includes_logprobs(body.get("include"))
        top = _integer(body, "top_logprobs", None, 0, most)
        return 0 if top is None and asked else top
    if endpoint != CHAT_COMPLETIONS:  # completions: logprobs is the count (a stored shape:
        key = "logprobs" if body.get("logprobs") is not None else "top_logprobs"  # top_logprobs)
        return _integer(body, key, None, 0, most)
    wanted = body.get("logprobs")
    if wanted is not None and type(wanted) is not bool:
        raise Rejected(
            WRONG_TYPE, f"body.logprobs = {show(wanted)} is not a boolean; set true or false"
        )
    top = _integer(body, "top_logprobs", None, 0, most)
    if wanted is False and top is not None:
        raise Rejected(
            CONFLICTING_FIELDS,
            "body sets top_logprobs with logprobs = false; set logprobs to true, or leave "
            "top_logprobs out",
        )
    if top is None:
        return 0 if wanted else None
    return top


def _includes_logprobs(value: Any) -> bool:
    """Whether a /v1/responses `include` asks for the output text's log probabilities; only
    that one is served (the others are about tools and reasoning, which are not)."""
    if value is None:
        return False
    if not isinstance(value, list):
        raise Rejected(
            WRONG_TYPE, f'body.include = {show(value)} is not a list; set ["{LOGPROBS_INCLUDE}"]'
        )
    for i, item in enumerate(value):
        if item != LOGPROBS_INCLUDE:
            raise Rejected(
                UNSUPPORTED_PARAMETER,
                f"body.include[{i}] = {show(item)} is not served here: only "
                f'"{LOGPROBS_INCLUDE}" is; remove it',
            )
    return bool(value)


def _encoding(body: Mapping[str, Any]) -> str | None:
    value = body.get("encoding_format")
    if value is None or value == "float":
        return None
    if value == "base64":
        return value
    raise Rejected(
        INVALID_VALUE,
        f'body.encoding_format = {show(value)}; use "float" (the default) or "base64" '
        "(little-endian float32, base64-encoded)",
    )


def _integer(body: Mapping[str, Any], key: str, default: Any, low: int, high: int) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int:
        raise Rejected(
            WRONG_TYPE,
            f"body.{key} = {show(value)} is not an integer; set an integer {low}..{high}",
        )
    if not low <= value <= high:
        raise Rejected(
            INVALID_VALUE, f"body.{key} = {value} is out of range; set an integer {low}..{high}"
        )
    return value


def _number(
    body: Mapping[str, Any], key: str, default: float, low: float, high: float, *, low_open: bool
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise Rejected(WRONG_TYPE, f"body.{key} = {show(value)} is not a number; set a number")
    allowed = f"> {low} and <= {high}" if low_open else f"{low} .. {high}"
    if not (low < value <= high if low_open else low <= value <= high):
        raise Rejected(
            INVALID_VALUE, f"body.{key} = {value} is out of range; set a number {allowed}"
        )
    return float(value) + 0.0  # one canonical zero: -0.0 becomes 0.0


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise Rejected(
            WRONG_TYPE,
            f"body.stop = {show(value)} is not a string or a list of strings; "
            f"set a string or a list of up to {MAX_STOP_SEQUENCES} strings",
        )
    if not 1 <= len(stops) <= MAX_STOP_SEQUENCES or "" in stops:
        raise Rejected(
            INVALID_VALUE,
            f"body.stop = {show(value)} has {len(stops)} sequences or an empty one; "
            f"set 1..{MAX_STOP_SEQUENCES} non-empty strings, or leave stop out",
        )
    return tuple(sorted(set(stops)))  # order and repeats do not change what stops
