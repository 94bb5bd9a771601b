"""The `logprobs` of a chat or completion choice, from a TOKEN_LOGPROBS result.

The payload (pipeline/core/token_logprobs.py) holds each generated token's id and
log probability and its k most likely alternatives. Rendered in OpenAI's
shapes:

| endpoint               | `choices[0].logprobs` |
|------------------------|-----------------------|
| `/v1/chat/completions` | `{"content": [{"token": T, "logprob": L, "bytes": [b, ...], "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}` |
| `/v1/completions`      | `{"tokens": [T, ...], "token_logprobs": [L, ...], "top_logprobs": [{T: L, ...}, ...], "text_offset": [o, ...]}` |

T is the token's text (`decode([id])`; the id as `"token_id:<id>"` without a
tokenizer, as vLLM spells it), `bytes` its UTF-8 bytes (a token that holds
part of a character decodes to U+FFFD, so its bytes are those of U+FFFD, not
the raw piece), `text_offset` where each token's text starts in the choice's
text (the sum of the texts before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.core.token_logprobs import TokenLogprobs


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), decoded once per id."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self.decode = decode
        self.known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self.known.get(token)
        if found is None:
            text = self.decode([token]) if self.decode is not None else f"token_id:{token}"
            found = self.known[token] = (text, list(text.encode("utf-8")))
        return found


def chat_logprobs(scored: TokenLogprobs, texts: TokenTexts) -> dict[str, Any]:
    content = []
    for token, logprob, ids, values in zip(
        scored.tokens, scored.logprobs, scored.top_ids, scored.top_logprobs, strict=True
    ):
        text, raw = texts(token)
        top = []
        for other, value in zip(ids, values, strict=True):
            other_text, other_raw = texts(other)
            top.append({"token": other_text, "logprob": value, "bytes": other_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(scored: TokenLogprobs, texts: TokenTexts) -> dict[str, Any]:
    tokens, offsets, tops = [], [], []
    at = 0
    for token, ids, values in zip(scored.tokens, scored.top_ids, scored.top_logprobs, strict=True):
        text, _ = texts(token)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        tops.append({texts(other)[0]: value for other, value in zip(ids, values, strict=True)})
    return {
        "tokens": tokens,
        "token_logprobs": scored.logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
