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
in the `tokenizer_config.json` beside `tokenizer.json`) is prompted in that
format instead, the one it was trained on: `NativeTemplate` renders it in a
sandboxed Jinja environment, as Hugging Face does (`messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token`; blocks trimmed). A
template that does not compile, or fails on a chunk's messages, is an error
naming the model and the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingest.chat_messages import ChatMessage
from pipeline.core.errors import TokenizerError

GENERATION_TAG = "<|assistant|>\n"


def render_role_tags(messages: Sequence[ChatMessage]) -> str:
    """The prompt for `messages`, (role, content) pairs, in the role-tag template."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + GENERATION_TAG


def _token_text(value: Any) -> str:
    """A special token from tokenizer_config.json: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


class NativeTemplate:
    """A model's own Jinja chat template, rendered in a sandbox."""

    def __init__(self, model: str, config: Path, values: dict[str, Any]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.model, self.config = model, config
        self._errors = TemplateError
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            self._template = environment.from_string(values["chat_template"])
        except TemplateError as exc:
            raise TokenizerError(
                f"model {model!r}: the chat_template in {config} does not compile ({exc}); "
                "fix it, or remove it to use the role-tag template"
            ) from exc
        self._specials = {
            "bos_token": _token_text(values.get("bos_token")),
            "eos_token": _token_text(values.get("eos_token")),
        }

    def __call__(self, messages: Sequence[ChatMessage]) -> str:
        try:
            return self._template.render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True,
                **self._specials,
            )
        except self._errors as exc:
            raise TokenizerError(
                f"model {self.model!r}: the chat_template in {self.config} failed on a "
                f"request ({exc})"
            ) from exc
