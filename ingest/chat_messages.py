"""Chat messages from a request body: `messages` (chat) and `input`/`instructions` (responses).

A message's `content` is a string, or a list of content parts as OpenAI
writes them. Text parts are joined with a newline into one string, as vLLM
does for chat templates that take string content (every template this
broker renders, ingest/chat_template.py). The models served here take text
only, so any other part is refused per line (`unsupported_content`) naming
the part, its type and the model:

| endpoint               | text parts                                  | refused parts |
|------------------------|---------------------------------------------|---------------|
| `/v1/chat/completions` | `{"type": "text", "text": ...}`             | `image_url`, `input_audio`, `file`, any other type |
| `/v1/responses`        | `input_text`, `output_text` (earlier answers), and `text` | `input_image`, `input_file`, `input_audio`, any other type |

`/v1/responses` takes `input` as a string (one user message) or a list of
messages (`{"role", "content"}`, optionally `"type": "message"`), and
`instructions` (a string) as a system message before them, as OpenAI
inserts it.
"""

from __future__ import annotations

from typing import Any, Final

from ingest.line_errors import (
    EMPTY_PROMPT,
    INVALID_VALUE,
    MISSING_FIELD,
    UNSUPPORTED_CONTENT,
    UNSUPPORTED_PARAMETER,
    WRONG_TYPE,
    Rejected,
    json_type,
    show,
)

CHAT_ROLES: Final = ("system", "developer", "user", "assistant")
CHAT_TEXT_PARTS: Final = frozenset({"text"})
RESPONSES_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
PART_SEPARATOR: Final = "\n"

ChatMessage = tuple[str, str]  # (role, content)


def chat_messages(value: Any, model: str) -> tuple[ChatMessage, ...]:
    """`body.messages` of a chat request; raise Rejected at the first bad message."""
    return _messages(value, "body.messages", model, CHAT_TEXT_PARTS, frozenset({"role", "content"}))


def responses_messages(body: dict[str, Any], model: str) -> tuple[ChatMessage, ...]:
    """`body.input` (and `body.instructions`) of a /v1/responses request as chat messages."""
    value = body["input"]
    if isinstance(value, str):
        if not value:
            raise Rejected(EMPTY_PROMPT, "body.input is an empty string; send some text")
        messages: tuple[ChatMessage, ...] = (("user", value),)
    else:
        keys = frozenset({"role", "content", "type"})
        messages = _messages(value, "body.input", model, RESPONSES_TEXT_PARTS, keys)
    instructions = body.get("instructions")
    if instructions is None:
        return messages
    if not isinstance(instructions, str):
        raise Rejected(
            WRONG_TYPE,
            f"body.instructions = {show(instructions)} is {json_type(instructions)}; set a string",
        )
    return (("system", instructions), *messages)


def _messages(
    value: Any, where: str, model: str, text_parts: frozenset[str], keys: frozenset[str]
) -> tuple[ChatMessage, ...]:
    wanted = 'a list of {"role": ..., "content": ...} objects'
    if not isinstance(value, list):
        raise Rejected(WRONG_TYPE, f"{where} = {show(value)} is {json_type(value)}; set {wanted}")
    if not value:
        raise Rejected(EMPTY_PROMPT, f"{where} is empty; send at least one message")
    messages = []
    for i, message in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise Rejected(WRONG_TYPE, f"{at} = {show(message)} is not an object; set {wanted}")
        if message.get("type", "message") != "message":
            raise Rejected(
                UNSUPPORTED_CONTENT,
                f"{at}.type = {show(message['type'])}: only messages are served here "
                '(no tool calls or their outputs); send {"role": ..., "content": ...}',
            )
        unknown = message.keys() - keys
        if unknown:
            raise Rejected(
                UNSUPPORTED_PARAMETER,
                f"{at}.{sorted(unknown)[0]} is not supported in a message; remove it "
                f"(accepted: {', '.join(sorted(keys))})",
            )
        role = _required(message, "role", at)
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise Rejected(
                INVALID_VALUE if isinstance(role, str) else WRONG_TYPE,
                f"{at}.role = {show(role)}; use one of {', '.join(CHAT_ROLES)}",
            )
        content = _required(message, "content", at)
        messages.append((role, _content(content, f"{at}.content", model, text_parts)))
    if not any(content for _, content in messages):
        raise Rejected(EMPTY_PROMPT, f"every message in {where} has empty content")
    return tuple(messages)


def _required(message: dict[str, Any], key: str, at: str) -> Any:
    if key not in message:
        raise Rejected(MISSING_FIELD, f"{at}.{key} is missing; add {at}.{key}")
    if message[key] is None:
        raise Rejected(WRONG_TYPE, f"{at}.{key} is null; set it")
    return message[key]


def _content(value: Any, where: str, model: str, text_parts: frozenset[str]) -> str:
    """A message's content as one string: itself, or its text parts joined by a newline."""
    if isinstance(value, str):
        return value
    wanted = f'a string or a list of {{"type": "{sorted(text_parts)[0]}", "text": ...}} parts'
    if not isinstance(value, list):
        raise Rejected(WRONG_TYPE, f"{where} = {show(value)} is {json_type(value)}; set {wanted}")
    texts = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise Rejected(WRONG_TYPE, f"{at} = {show(part)} is {json_type(part)}; set {wanted}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise Rejected(
                MISSING_FIELD if kind is None else WRONG_TYPE,
                f"{at}.type = {show(kind)}; set it to one of {', '.join(sorted(text_parts))}",
            )
        if kind not in text_parts:
            raise Rejected(
                UNSUPPORTED_CONTENT,
                f"{at} has type {show(kind)}; model {show(model)} takes text only "
                f"(parts of type {', '.join(sorted(text_parts))}): remove the part, or send it "
                "to a model that takes it",
            )
        if "text" not in part:
            raise Rejected(MISSING_FIELD, f"{at}.text is missing; add {at}.text: a string")
        text = part["text"]
        if not isinstance(text, str):
            found = "is null" if text is None else f"= {show(text)} is {json_type(text)}"
            raise Rejected(WRONG_TYPE, f"{at}.text {found}; set a string")
        texts.append(text)
    return PART_SEPARATOR.join(texts)
