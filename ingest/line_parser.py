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
from operator import countOf
from typing import Any, Final

import numpy as np
import orjson

from ingest.catalog import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES, ModelCatalog, ModelEntry
from ingest.chat_messages import ChatMessage, chat_messages, responses_messages
from ingest.line_errors import (
    CONFLICTING_FIELDS,
    EMPTY_PROMPT,
    ENDPOINT_NOT_SERVED,
    INVALID_JSON,
    INVALID_VALUE,
    LINE_TOO_MANY_TOKENS,
    MISSING_FIELD,
    NESTING_TOO_DEEP,
    NOT_AN_OBJECT,
    PROMPT_TOO_LONG,
    TEXT_NOT_ACCEPTED,
    TOKEN_OUT_OF_RANGE,
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
from ingest.request_shape import MAX_SEED, SHAPE_PARAMETERS, Shape, parse_shape

MAX_CUSTOM_ID_CHARS: Final = 512
TOKEN_ID_LIMIT: Final = 2**32
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

TextPrompt = str | tuple[ChatMessage, ...]
Prompt = TextPrompt | np.ndarray  # text, or uint32 token ids


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
        prompts = (_token_ids(body["prompt_token_ids"], model, model_name),)
    elif url == CHAT_COMPLETIONS:
        _takes_text(model, model_name, text_field)
        prompts = (chat_messages(body["messages"], model_name),)
    elif url == RESPONSES:
        _takes_text(model, model_name, text_field)
        prompts = (responses_messages(body, model_name),)
    else:
        prompts = _prompts(body[text_field], text_field, model, model_name, catalog.max_parts)
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


def _takes_text(model: ModelEntry, model_name: str, field: str) -> None:
    if not model.takes_text:
        raise Rejected(
            TEXT_NOT_ACCEPTED,
            f"model {show(model_name)} has no tokenizer configured, so it takes token ids only; "
            f"send body.prompt_token_ids instead of body.{field}, or set a tokenizer "
            "for the model in the configuration",
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


def _prompts(
    value: Any, field: str, entry: ModelEntry, model: str, max_parts: int
) -> tuple[Prompt, ...]:
    """`input` (embeddings) or `prompt` (completions): a string, a list of strings, a list of
    token ids (one prompt), or a list of token-id lists."""
    if isinstance(value, str):
        _takes_text(entry, model, field)
        return (_text(value, field),)
    if not isinstance(value, list):
        raise Rejected(
            WRONG_TYPE,
            f"body.{field} = {show(value)} is {_json_type(value)}; set a string, a list of "
            "strings, a list of token ids or a list of token-id lists",
        )
    if not value:
        raise Rejected(EMPTY_PROMPT, f"body.{field} is an empty list; send at least one input")
    if len(value) > max_parts and not isinstance(value[0], int):
        raise Rejected(
            TOO_MANY_INPUTS,
            f"body.{field} has {len(value)} inputs; at most {max_parts} per line "
            "(ingest.max_inputs_per_line): split it into several lines",
        )
    first = type(value[0])
    if first is int or (first is float and not isinstance(value[0], bool)):
        return (_token_ids(value, entry, model, f"body.{field}"),)
    if first is str:
        _takes_text(entry, model, field)
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise Rejected(
                    WRONG_TYPE,
                    f"body.{field}[{i}] = {show(v)} is {_json_type(v)}; a list of strings "
                    "holds only strings",
                )
        return tuple(_text(v, f"{field}[{i}]") for i, v in enumerate(value))
    if first is list:
        ids = []
        for i, v in enumerate(value):
            if not isinstance(v, list):
                raise Rejected(
                    WRONG_TYPE,
                    f"body.{field}[{i}] = {show(v)} is {_json_type(v)}; a list of token-id "
                    "lists holds only lists",
                )
            ids.append(_token_ids(v, entry, model, f"body.{field}[{i}]"))
        return tuple(ids)
    raise Rejected(
        WRONG_TYPE,
        f"body.{field}[0] = {show(value[0])} is {_json_type(value[0])}; set strings, token ids "
        "or token-id lists",
    )


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


def _token_ids(
    value: Any, entry: ModelEntry, model: str, where: str = "body.prompt_token_ids"
) -> np.ndarray:
    limit = entry.prompt_limit_tokens
    if not isinstance(value, list):
        raise Rejected(
            WRONG_TYPE, f"{where} = {show(value)} is {_json_type(value)}; set a list of integers"
        )
    if not value:
        raise Rejected(EMPTY_PROMPT, f"{where} is empty; send at least one token id")
    if countOf(map(type, value), int) != len(value):  # exact: a JSON true is a bool, not 1
        at, bad = next((i, v) for i, v in enumerate(value) if type(v) is not int)
        if type(bad) is float and not -TOKEN_ID_LIMIT < bad < TOKEN_ID_LIMIT:
            # orjson reads an integer beyond 64 bits as a float: it is a number, just too big
            raise Rejected(
                TOKEN_OUT_OF_RANGE,
                f"{where}[{at}] = {show(bad)} is out of range; token ids are "
                f"0..{TOKEN_ID_LIMIT - 1}",
            )
        raise Rejected(
            WRONG_TYPE,
            f"{where} holds {show(bad)}, {_json_type(bad)}; send integers 0..{TOKEN_ID_LIMIT - 1}",
        )
    if len(value) > limit:
        raise Rejected(
            PROMPT_TOO_LONG,
            f"{where} has {len(value)} tokens; model {show(model)} takes at most {limit}: "
            "shorten the prompt",
        )
    try:
        ids = np.array(value, dtype=np.int64)
    except OverflowError:
        ids = None
    if ids is None or bool(((ids < 0) | (ids >= TOKEN_ID_LIMIT)).any()):
        at = next(i for i, v in enumerate(value) if not 0 <= v < TOKEN_ID_LIMIT)
        raise Rejected(
            TOKEN_OUT_OF_RANGE,
            f"{where}[{at}] = {show(value[at])} is out of range; token ids are "
            f"0..{TOKEN_ID_LIMIT - 1}",
        )
    vocab = entry.vocab_size
    if vocab is not None and int(ids.max()) >= vocab:
        at = int(np.argmax(ids >= vocab))
        raise Rejected(TOKEN_OUT_OF_RANGE, beyond_vocabulary(model, at, int(ids[at]), vocab, where))
    return ids.astype(np.uint32)


def beyond_vocabulary(
    model: str, at: int, token: int, vocab: int, where: str = "body.prompt_token_ids"
) -> str:
    """The reason for a token id the model cannot run (also the front's, ingest.chunk_check)."""
    return (
        f"{where}[{at}] = {token} is beyond the vocabulary of model "
        f"{show(model)}: it has {vocab} tokens (ids 0..{vocab - 1}); tokenise with the "
        "model's own tokenizer"
    )


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise Rejected(
            WRONG_TYPE, f"body.{field} = {show(value)} is {_json_type(value)}; set a string"
        )
    if not value:
        raise Rejected(EMPTY_PROMPT, f"body.{field} is an empty string; send some text")
    return value
