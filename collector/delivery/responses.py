"""The body of a `/v1/responses` output line: OpenAI's Response object for generated text.

    {"id": "resp_<request_id>", "object": "response", "created_at": T, "status": S,
     "incomplete_details": I, "error": null, "model": M, "instructions": null,
     "max_output_tokens": B, "temperature": t, "top_p": p,
     "output": [{"type": "message", "id": "msg_<request_id>", "status": S, "role": "assistant",
                 "content": [{"type": "output_text", "text": TEXT, "annotations": [],
                              "logprobs": LP}]}],
     "parallel_tool_calls": false, "tool_choice": "none", "tools": [], "top_logprobs": k,
     "usage": {"input_tokens": P,
               "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": K, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": P + K},
     "token_ids": [t, ...]}

S is "completed" when the model stopped by itself (F "stop" in
collector/delivery/lines.py), else "incomplete" with I
`{"reason": "max_output_tokens"}` (I is null when completed). `token_ids`
is an extension, as in the chat and completion bodies, so nothing is lost
without a tokenizer. The instructions are part of the prompt (rendered into
it at ingest) and not stored with the result, so `instructions` is null.

LP is `[]` unless the request asked for log probabilities (`top_logprobs`,
or `include: ["message.output_text.logprobs"]`: the shape's `top_logprobs`
k, ingest/request_shape.py) and the result is a TOKEN_LOGPROBS one; then it
holds one `{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}, ...]}` per generated token, as chat's
`logprobs.content` (collector/delivery/logprobs.py). `top_logprobs` is k,
or null when not asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Generated:
    """One generated item as every generated line's body tells it (this module's Response
    object, collector/delivery/line_bodies.py's chat.completion and text_completion)."""

    request_id: str
    created: int  # the job's creation time, unix seconds
    model: str
    text: str  # the decoded token ids ("" without a tokenizer)
    token_ids: list[int]
    finish: str  # "stop" or "length"
    prompt: int  # prompt tokens


def response_body(
    generated: Generated,
    shape: Mapping[str, Any],
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The Response object for one generated item (see the module docstring); `logprobs`
    the output text's per-token log probabilities, when the result has them."""
    request_id, created, model = generated.request_id, generated.created, generated.model
    text, finish, prompt = generated.text, generated.finish, generated.prompt
    status = "completed" if finish == "stop" else "incomplete"
    completion = len(generated.token_ids)
    return {
        "id": "resp_" + request_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "incomplete_details": None if finish == "stop" else {"reason": "max_output_tokens"},
        "error": None,
        "model": model,
        "instructions": None,
        "max_output_tokens": shape.get("max_tokens"),
        "temperature": shape.get("temperature"),
        "top_p": shape.get("top_p"),
        "output": [
            {
                "type": "message",
                "id": "msg_" + request_id,
                "status": status,
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": text,
                        "annotations": [],
                        "logprobs": logprobs or [],
                    }
                ],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "top_logprobs": shape.get("top_logprobs"),
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "token_ids": generated.token_ids,
    }
