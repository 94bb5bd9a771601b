"""Chat messages to one prompt string, for models whose tokenizer has no chat template.

The role-tag template writes each message as its role in a tag on a line of
its own, then the content and a newline, and ends with the assistant tag, the
cue for the model to answer:

    <|system|>
    You are terse.
    <|user|>
    Name a prime.
    <|assistant|>

The tags are plain text to the tokenizer (unless it defines them as tokens).
A model whose tokenizer ships its own Jinja chat template (a `chat_template`
in the `tokenizer_config.json` beside `tokenizer.json`) is refused for chat
text at load time by `ingest.tokenize` rather than prompted in a format it
was not trained on; such clients send `prompt_token_ids` rendered with the
model's own template.
"""

from __future__ import annotations

from collections.abc import Sequence

from ingest.line_parser import ChatMessage

GENERATION_TAG = "<|assistant|>\n"


def render_role_tags(messages: Sequence[ChatMessage]) -> str:
    """The prompt for `messages`, (role, content) pairs, in the role-tag template."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + GENERATION_TAG
