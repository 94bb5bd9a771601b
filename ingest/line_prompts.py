"""The prompt of a batch line: text, a list of texts, token ids, or a list of token-id
lists, checked against the model that will run it (`ingest.line_parser` calls these).

A text prompt is a string, or a chat's messages (`ingest.chat_messages`); token
ids are u32 (0..TOKEN_ID_LIMIT-1), non-empty, within the model's prompt limit
and vocabulary. Each check raises `Rejected` naming the field and the fix.
"""

from __future__ import annotations

from operator import countOf
from typing import Any, Final

import numpy as np

from ingest.catalog import ModelEntry
from ingest.chat_messages import ChatMessage
from ingest.line_errors import (
    EMPTY_PROMPT,
    PROMPT_TOO_LONG,
    TEXT_NOT_ACCEPTED,
    TOKEN_OUT_OF_RANGE,
    TOO_MANY_INPUTS,
    WRONG_TYPE,
    Rejected,
    show,
)
from ingest.line_errors import json_type as _json_type

TOKEN_ID_LIMIT: Final = 2**32

TextPrompt = str | tuple[ChatMessage, ...]
Prompt = TextPrompt | np.ndarray  # text, or uint32 token ids


def require_text(model: ModelEntry, model_name: str, field: str) -> None:
    """Refuse a text prompt (`body.<field>`) for a model that has no tokenizer."""
    if not model.takes_text:
        raise Rejected(
            TEXT_NOT_ACCEPTED,
            f"model {show(model_name)} has no tokenizer configured, so it takes token ids only; "
            f"send body.prompt_token_ids instead of body.{field}, or set a tokenizer "
            "for the model in the configuration",
        )


def prompts_of(
    value: Any, field: str, entry: ModelEntry, model: str, max_parts: int
) -> tuple[Prompt, ...]:
    """`input` (embeddings) or `prompt` (completions): a string, a list of strings, a list of
    token ids (one prompt), or a list of token-id lists."""
    if isinstance(value, str):
        require_text(entry, model, field)
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
        return (token_ids_of(value, entry, model, f"body.{field}"),)
    if first is str:
        require_text(entry, model, field)
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
            ids.append(token_ids_of(v, entry, model, f"body.{field}[{i}]"))
        return tuple(ids)
    raise Rejected(
        WRONG_TYPE,
        f"body.{field}[0] = {show(value[0])} is {_json_type(value[0])}; set strings, token ids "
        "or token-id lists",
    )


def token_ids_of(
    value: Any, entry: ModelEntry, model: str, where: str = "body.prompt_token_ids"
) -> np.ndarray:
    """`value` (at `where`) as uint32 token ids the model can run, or Rejected."""
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
