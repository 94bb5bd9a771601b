"""One output line built as a dict, one at a time: the forms collector/delivery/lines.py has
no page template for (/v1/responses, logprobs) and the rows of fan-out lines, which the join
takes as dicts. The bodies are the ones lines.py's module docstring lists; the same bytes as
the templates' (tests/test_results_templates.py).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from collector.delivery import line_ids
from collector.delivery.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from collector.delivery.responses import Generated, response_body
from collector.delivery.result_page import Checked, ExportContext, ResultPage, result_words
from ingest.catalog import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from pipeline.core.ragged import ranges
from pipeline.core.result_kinds import ResultKind
from pipeline.core.token_logprobs import unpack

_DUMPS_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY


def format_lines_one_by_one(
    page: ResultPage, context: ExportContext, checked: Checked, as_dicts: bool = False
) -> list[Any]:
    """Output lines for the checked results: columns converted once, then one dict per item
    (the forms line_templates.py has no template for; tests hold the templates to it), returned
    as such with `as_dicts`, for the join, which would otherwise parse them back."""
    results = checked.results
    if not len(results):
        return []
    kind = page.kind[results]
    endpoints = checked.endpoints
    offsets = np.asarray(page.offsets, dtype=np.int64)
    starts = offsets[results]
    counts = (offsets[results + 1] - starts) // 4
    words, word_starts = result_words(page.payload, starts, counts)
    floats = words.view("<f4").astype(np.float32, copy=False)  # native order for orjson
    embeds = kind == ResultKind.VECTOR
    if embeds.any():  # gather the token ids alone, so tolist() converts no embedding
        token_counts = np.where(embeds, 0, counts)
        token_starts = np.cumsum(token_counts) - token_counts
        tokens = words[ranges(word_starts, token_counts)].tolist()
    else:
        token_starts, tokens = word_starts, words.tolist()
    ids, request_ids = line_ids.request_ids(context.job_id, page.index[results])
    created = context.created_ns // 1_000_000_000
    model, decode, custom_ids = context.model, context.decode, page.custom_ids
    prompts, counts_l = page.prompt_tokens[results].tolist(), counts.tolist()
    float_at, token_at = word_starts.tolist(), token_starts.tolist()
    shape_ids = page.shape[results].tolist()
    scored_kind = (kind == ResultKind.TOKEN_LOGPROBS).tolist()
    texts = TokenTexts(decode)
    lines = []
    for j, i in enumerate(results.tolist()):
        endpoint, max_tokens = endpoints[j]
        count, prompt = counts_l[j], prompts[j]
        if endpoint == EMBEDDINGS:
            start = float_at[j]
            shape = context.shapes.get(shape_ids[j]) or {}
            body = embedding_body(
                floats[start : start + count], model, prompt, shape.get("encoding_format")
            )
        else:
            scored = None
            if scored_kind[j]:
                scored = unpack(words[float_at[j] : float_at[j] + count])
                token_ids = scored.tokens
            else:
                start = token_at[j]
                token_ids = tokens[start : start + count]
            text = decode(token_ids) if decode is not None else ""
            finish = "length" if len(token_ids) >= max_tokens else "stop"
            generated = Generated(request_ids[j], created, model, text, token_ids, finish, prompt)
            if endpoint == RESPONSES:
                shape = context.shapes.get(shape_ids[j]) or {}
                scores = None if scored is None else chat_logprobs(scored, texts)["content"]
                body = response_body(generated, shape, scores)
            else:
                body = generated_body(endpoint, generated)
                if scored is not None:
                    render = chat_logprobs if endpoint == CHAT_COMPLETIONS else completion_logprobs
                    body["choices"][0]["logprobs"] = render(scored, texts)
        line = {
            "id": "batch_req_" + ids[j],
            "custom_id": custom_ids[i],
            "response": {"status_code": 200, "request_id": request_ids[j], "body": body},
            "error": None,
        }
        lines.append(line if as_dicts else orjson.dumps(line, option=_DUMPS_OPTIONS))
    return lines


def embedding_body(
    embedding: np.ndarray, model: str, prompt: int, encoding: str | None = None
) -> dict[str, Any]:
    """The body of an embedding line: the vector as a list, or as base64 when asked."""
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        value: Any = base64.b64encode(embedding.astype("<f4", copy=False).tobytes()).decode()
    else:
        value = embedding
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": value}],
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


def generated_body(endpoint: str, generated: Generated) -> dict[str, Any]:
    """The body of a chat.completion or text_completion line (without logprobs)."""
    text, token_ids, prompt = generated.text, generated.token_ids, generated.prompt
    chat = endpoint == CHAT_COMPLETIONS
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = generated.finish
    choice["token_ids"] = token_ids
    completion = len(token_ids)
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + generated.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": generated.created,
        "model": generated.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
