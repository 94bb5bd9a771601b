"""Check one OpenAI Batch input line and take out what the broker stores.

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}

`parse_line` runs the checks in a fixed order and raises `Rejected` (code,
reason, and the line's custom_id once it is known) at the first that fails;
nothing in a line, however deeply nested, escapes as another exception. The prompt is either text to tokenise
(`input` for embeddings, `prompt` for completions, `messages` for chat) or
token ids (`prompt_token_ids`, any endpoint). Duplicate custom_ids and the
length of text prompts are checked later, per chunk (`ingest.batch_input`,
`ingest.tokenize`). docs/input-format.md describes the format and each code.

A line may fan out to several parts (an embeddings `input` list, a
completions `prompt` list, `n` samples): `ParsedLine.parts()` lists them in
OpenAI's order, part p = i * n + j being sample j of prompt i.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import orjson

from ingest.catalog import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES, ModelCatalog
from ingest.chat_messages import chat_messages, responses_messages
from ingest.line_errors import (
    CONFLICTING_FIELDS,
    ENDPOINT_NOT_SERVED,
    INVALID_JSON,
    INVALID_VALUE,
    LINE_TOO_MANY_TOKENS,
    MISSING_FIELD,
    NESTING_TOO_DEEP,
    NOT_AN_OBJECT,
    TOO_MANY_INPUTS,
    UNKNOWN_MODEL,
    UNKNOWN_URL,
    UNSUPPORTED_PARAMETER,
    WRONG_METHOD,
    WRONG_TYPE,
    Rejected,
    show,
)
from ingest.line_errors import json_type as _json_type
from ingest.line_prompts import Prompt, TextPrompt, prompts_of, require_text, token_ids_of
from ingest.request_shape import MAX_SEED, SHAPE_PARAMETERS, Shape, parse_shape

MAX_CUSTOM_ID_CHARS: Final = 512
LINE_KEYS: Final = frozenset({"custom_id", "method", "url", "body"})
# The body key holding text input, per endpoint.
TEXT_FIELD: Final[dict[str, str]] = {
    EMBEDDINGS: "input",
    CHAT_COMPLETIONS: "messages",
    "/v1/completions": "prompt",
    RESPONSES: "input",
}
# Body keys accepted but not part of the shape: `user` is ignored; `instructions` is part of
# a /v1/responses prompt (ingest/chat_messages.py).
_OTHER_KEYS: Final[dict[str, tuple[str, ...]]] = {
    EMBEDDINGS: ("model", "prompt_token_ids", "user"),
    CHAT_COMPLETIONS: ("model", "prompt_token_ids", "user", "n"),
    "/v1/completions": ("model", "prompt_token_ids", "user", "n"),
    RESPONSES: ("model", "prompt_token_ids", "user", "instructions"),
}
MAX_N: Final = 128  # OpenAI's largest `n`
BODY_KEYS: Final[dict[str, frozenset[str]]] = {
    url: frozenset((*_OTHER_KEYS[url], TEXT_FIELD[url], *SHAPE_PARAMETERS[url]))
    for url in TEXT_FIELD
}


@dataclass(slots=True)  # not frozen: built once per line, and a frozen __init__ costs 4x
class ParsedLine:
    """A line that passed every per-line check: exactly one of `text` and `token_ids` is set
    (its first prompt); `prompts` holds every prompt of a list, `n` the samples of each.
    Treat it as read-only."""

    custom_id: str
    model: str
    shape: Shape
    text: TextPrompt | None
    token_ids: np.ndarray | None  # uint32, non-empty, within the model's prompt limit
    prompts: tuple[Prompt, ...] = ()  # a list's prompts (the first is text/token_ids); () for one
    n: int = 1

    @property
    def part_count(self) -> int:
        return max(1, len(self.prompts)) * self.n

    def parts(self) -> list[tuple[Shape, TextPrompt | None, np.ndarray | None]]:
        """(shape, text, token_ids) of each part, part p = i * n + j: sample j of prompt i.
        With a seed, sample j is drawn with seed + j (wrapping within 0..MAX_SEED)."""
        prompts = self.prompts or ((self.text if self.token_ids is None else self.token_ids),)
        shapes = [self.shape]
        seed = self.shape.seed
        for j in range(1, self.n):
            shapes.append(self.shape if seed is None else replace(self.shape, seed=_seed(seed, j)))
        out: list[tuple[Shape, TextPrompt | None, np.ndarray | None]] = []
        for prompt in prompts:
            ids = prompt if isinstance(prompt, np.ndarray) else None
            text = None if ids is not None else prompt
            out.extend((shape, text, ids) for shape in shapes)
        return out


def _seed(seed: int, j: int) -> int:
    return (seed + j) % (MAX_SEED + 1)


def parse_line(raw: bytes, catalog: ModelCatalog) -> ParsedLine:
    """Check one line (without its newline); raise Rejected at the first failed check."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _not_json(raw, exc) from None
    if not isinstance(obj, dict):
        raise Rejected(
            NOT_AN_OBJECT,
            f"the line is {_json_type(obj)}, not an object; write one object per line "
            "with custom_id, method, url and body",
        )
    custom_id = None
    try:
        custom_id = _custom_id(obj)
        return _request(obj, custom_id, catalog)
    except Rejected as exc:
        exc.custom_id = custom_id
        raise
    except RecursionError:  # a deeply nested value reached a recursive check or message
        raise too_deep(custom_id) from None


def _request(obj: dict[str, Any], custom_id: str, catalog: ModelCatalog) -> ParsedLine:
    method = _field(obj, "method", str, "", '"POST"')
    if method != "POST":
        raise Rejected(WRONG_METHOD, f'method = {show(method)}; every batch request uses "POST"')
    url = _field(obj, "url", str, "", "an endpoint path")
    if url not in TEXT_FIELD:
        raise Rejected(
            UNKNOWN_URL, f"url = {show(url)} is not an endpoint; use one of {', '.join(TEXT_FIELD)}"
        )
    _refuse_unknown(obj, LINE_KEYS, "the line", "")
    body = _field(obj, "body", dict, "", "an object with model and the request")
    model_name = _field(body, "model", str, "body.", "a model name")
    model = catalog.models.get(model_name)
    if model is None:
        raise Rejected(
            UNKNOWN_MODEL,
            f"body.model = {show(model_name)} is not served here; known models: "
            f"{catalog.known_models()}; set body.model to one of them",
        )
    if url not in model.endpoints:
        raise Rejected(
            ENDPOINT_NOT_SERVED,
            f"model {show(model_name)} does not serve {url}; it serves "
            f"{', '.join(sorted(model.endpoints))}: change url, or pick a model that serves it",
        )
    _refuse_unknown(body, BODY_KEYS[url], f"{url} body", "body.")
    text_field = TEXT_FIELD[url]
    has_text = body.get(text_field) is not None
    has_ids = body.get("prompt_token_ids") is not None
    if has_text and has_ids:
        raise Rejected(
            CONFLICTING_FIELDS,
            f"body sets both {text_field} and prompt_token_ids; send text or token ids, not both",
        )
    if not has_text and not has_ids:
        raise Rejected(
            MISSING_FIELD,
            f"body has neither {text_field} nor prompt_token_ids; add one of them",
        )
    prompts: tuple[Prompt, ...] = ()
    if has_ids:
        prompts = (token_ids_of(body["prompt_token_ids"], model, model_name),)
    elif url == CHAT_COMPLETIONS:
        require_text(model, model_name, text_field)
        prompts = (chat_messages(body["messages"], model_name),)
    elif url == RESPONSES:
        require_text(model, model_name, text_field)
        prompts = (responses_messages(body, model_name),)
    else:
        prompts = prompts_of(body[text_field], text_field, model, model_name, catalog.max_parts)
    n = _samples(body.get("n"))
    parts = len(prompts) * n
    if parts > catalog.max_parts:
        raise Rejected(
            TOO_MANY_INPUTS,
            f"the line asks for {parts} results ({len(prompts)} prompts x n = {n}); at most "
            f"{catalog.max_parts} per line (ingest.max_inputs_per_line): split it into "
            "several lines",
        )
    first = prompts[0]
    ids = first if isinstance(first, np.ndarray) else None
    if ids is not None:  # all token ids (`_prompts` takes no list of text and ids mixed)
        id_tokens = sum(len(p) for p in prompts) * n
        if id_tokens > catalog.max_line_tokens:
            raise Rejected(
                LINE_TOO_MANY_TOKENS, too_many_tokens(id_tokens, catalog.max_line_tokens)
            )
    text = None if ids is not None else first
    shape = parse_shape(body, url)
    if shape.top_logprobs is not None and not model.logprobs:
        raise Rejected(UNSUPPORTED_PARAMETER, no_logprobs(model_name, model.engine, url))
    return ParsedLine(
        custom_id,
        model_name,
        shape,
        text,
        ids,
        prompts if len(prompts) > 1 else (),
        n,
    )


def too_many_tokens(tokens: int, budget: int) -> str:
    """The reason for a line whose parts' prompts exceed the per-line token budget."""
    return (
        f"the line's prompts have {tokens} tokens together (counting each of the n samples); "
        f"at most {budget} per line (ingest.max_line_tokens): split it into several lines"
    )


def _samples(value: Any) -> int:
    """`n`: samples per prompt, 1..MAX_N (absent or null: 1)."""
    if value is None:
        return 1
    if type(value) is not int:
        raise Rejected(
            WRONG_TYPE, f"body.n = {show(value)} is {_json_type(value)}; set an integer 1..{MAX_N}"
        )
    if not 1 <= value <= MAX_N:
        raise Rejected(
            INVALID_VALUE, f"body.n = {value} is out of range; set an integer 1..{MAX_N}"
        )
    return value


def no_logprobs(model: str, engine: str, url: str = CHAT_COMPLETIONS) -> str:
    """The reason for logprobs asked of a model whose engine gives none."""
    asked, fields = "body.logprobs", "logprobs and top_logprobs"
    if url == RESPONSES:
        asked, fields = "body.top_logprobs", 'top_logprobs and "message.output_text.logprobs"'
        fields += " from include"
    return (
        f"{asked}: model {show(model)} runs on engine {engine or 'unknown'}, which gives "
        f"no token log probabilities; remove {fields}, or send the request "
        "to a model on the transformers engine"
    )


def _not_json(raw: bytes, exc: orjson.JSONDecodeError) -> Rejected:
    """The rejection for a line orjson cannot read: bad UTF-8, too deep, or not JSON."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        found = " ".join(f"0x{b:02x}" for b in raw[bad.start : bad.end])
        return Rejected(
            INVALID_JSON,
            f"the line is not valid UTF-8: byte {bad.start + 1} ({found}): {bad.reason}; "
            "save the file as UTF-8 (JSON text is UTF-8)",
        )
    if "depth limit" in exc.msg or "recursion" in exc.msg:
        return Rejected(NESTING_TOO_DEEP, _too_deep(f"at character {exc.pos}"))
    return Rejected(
        INVALID_JSON,
        f"not valid JSON at character {exc.pos}: {exc.msg}; write one JSON object per line",
    )


def _too_deep(where: str) -> str:
    return (
        f"the line nests lists or objects too deeply ({where}); a request needs only a few "
        "levels: flatten it"
    )


def too_deep(custom_id: str | None) -> Rejected:
    """The rejection for a line whose checking ran out of stack (RecursionError)."""
    rejected = Rejected(NESTING_TOO_DEEP, _too_deep("checking it ran out of stack"))
    rejected.custom_id = custom_id
    return rejected


def _custom_id(obj: dict[str, Any]) -> str:
    custom_id = _field(obj, "custom_id", str, "", "a string unique within the file")
    if not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise Rejected(
            INVALID_VALUE,
            f"custom_id = {show(custom_id)} has {len(custom_id)} characters; use "
            f"1..{MAX_CUSTOM_ID_CHARS}",
        )
    return custom_id


def _field(obj: dict[str, Any], key: str, kind: type, prefix: str, wanted: str) -> Any:
    if key not in obj:
        raise Rejected(MISSING_FIELD, f"{prefix}{key} is missing; add {prefix}{key}: {wanted}")
    value = obj[key]
    if not isinstance(value, kind):
        found = "is null" if value is None else f"= {show(value)} is {_json_type(value)}"
        raise Rejected(WRONG_TYPE, f"{prefix}{key} {found}; set it to {wanted}")
    return value


def _refuse_unknown(obj: dict[str, Any], allowed: frozenset[str], what: str, prefix: str) -> None:
    if allowed.issuperset(obj):  # the usual line: no set built
        return
    unknown = obj.keys() - allowed
    if unknown:
        first = sorted(unknown)[0]
        raise Rejected(
            UNSUPPORTED_PARAMETER,
            f"{prefix}{first} is not supported in {what}; remove it (accepted: "
            f"{', '.join(sorted(allowed))})",
        )
