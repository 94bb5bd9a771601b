"""Error records for bad input lines, their codes, and the OpenAI Batch error line.

A bad line never sinks its job: it becomes one `LineError` and the other
lines go on. Each record says where (1-based `line`, and `custom_id` when the
line had a readable one), what (`code`, one of `CODES`) and why and what to
do (`message`, which starts with the line number so it reads alone in a log).
docs/input-format.md lists every code with an example message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from pipeline.core.errors import InputLineError

LINE_TOO_LONG: Final = "line_too_long"
INVALID_JSON: Final = "invalid_json"
NESTING_TOO_DEEP: Final = "nesting_too_deep"
NOT_AN_OBJECT: Final = "not_an_object"
MISSING_FIELD: Final = "missing_field"
WRONG_TYPE: Final = "wrong_type"
INVALID_VALUE: Final = "invalid_value"
UNSUPPORTED_PARAMETER: Final = "unsupported_parameter"
UNSUPPORTED_CONTENT: Final = "unsupported_content"  # a content part the model cannot take
CONFLICTING_FIELDS: Final = "conflicting_fields"
WRONG_METHOD: Final = "wrong_method"
UNKNOWN_URL: Final = "unknown_url"
UNKNOWN_MODEL: Final = "unknown_model"
ENDPOINT_NOT_SERVED: Final = "endpoint_not_served"
TEXT_NOT_ACCEPTED: Final = "text_not_accepted"
DUPLICATE_CUSTOM_ID: Final = "duplicate_custom_id"
EMPTY_PROMPT: Final = "empty_prompt"
TOKEN_OUT_OF_RANGE: Final = "token_out_of_range"
PROMPT_TOO_LONG: Final = "prompt_too_long"
TOO_MANY_INPUTS: Final = "too_many_inputs"  # more parts in one line than allowed
LINE_TOO_MANY_TOKENS: Final = "line_too_many_tokens"  # the parts' prompts beyond the budget

# Every code a LineError may carry, in the order the checks run.
CODES: Final[tuple[str, ...]] = (
    LINE_TOO_LONG,
    INVALID_JSON,
    NESTING_TOO_DEEP,
    NOT_AN_OBJECT,
    MISSING_FIELD,
    WRONG_TYPE,
    INVALID_VALUE,
    UNSUPPORTED_PARAMETER,
    CONFLICTING_FIELDS,
    WRONG_METHOD,
    UNKNOWN_URL,
    UNKNOWN_MODEL,
    ENDPOINT_NOT_SERVED,
    TEXT_NOT_ACCEPTED,
    DUPLICATE_CUSTOM_ID,
    UNSUPPORTED_CONTENT,
    EMPTY_PROMPT,
    TOKEN_OUT_OF_RANGE,
    PROMPT_TOO_LONG,
    TOO_MANY_INPUTS,
    LINE_TOO_MANY_TOKENS,
)


@dataclass(frozen=True, slots=True)
class LineError:
    """One bad input line: where, which check failed, and what to do about it."""

    line: int
    custom_id: str | None
    code: str
    message: str

    @classmethod
    def at(cls, line: int, custom_id: str | None, code: str, reason: str) -> LineError:
        """Build a record whose message is `reason` prefixed with the line and custom_id."""
        where = (
            f"line {line}" if custom_id is None else f"line {line} (custom_id {show(custom_id)})"
        )
        return cls(line, custom_id, code, f"{where}: {reason}")

    def to_exception(self) -> InputLineError:
        """The strict-mode exception for this line."""
        return InputLineError(
            f"{self.message} [{self.code}]; strict mode refuses the whole file: "
            "fix this line and submit again, or submit without --strict to skip bad lines",
            line=self.line,
            custom_id=self.custom_id,
            code=self.code,
        )

    def to_batch_error(self, job_id: str = "") -> dict[str, Any]:
        """The OpenAI Batch error-line object for this record.

        `id` is deterministic, `{job_id}-line-{line}` (or `line-{line}`
        without a job id), so writing the error file twice yields the same
        bytes.
        """
        request_id = f"{job_id}-line-{self.line}" if job_id else f"line-{self.line}"
        return {
            "id": request_id,
            "custom_id": self.custom_id,
            "response": None,
            "error": {"code": self.code, "message": self.message},
        }

    def to_batch_error_line(self, job_id: str = "") -> bytes:
        """`to_batch_error` as one JSONL line, newline included."""
        return orjson.dumps(self.to_batch_error(job_id), option=orjson.OPT_APPEND_NEWLINE)


def show(value: Any, limit: int = 60) -> str:
    """A value taken from input, spelt as JSON and cut to `limit` characters, for messages.

    Never recurses: a value nested deeper than orjson writes is shown by the
    opening brackets of its first branch ("[[[[..."), and an integer beyond
    64 bits by its digits.
    """
    try:
        text = orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):  # an integer beyond 64 bits, or deep nesting
        text = str(value) if isinstance(value, int) else _opening(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type(value: Any) -> str:
    """The JSON type of a parsed value with its article ("a list", "null"), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _opening(value: Any, limit: int) -> str:
    """The first `limit` opening brackets of a deeply nested list or object, without recursion."""
    brackets: list[str] = []
    while isinstance(value, list | dict) and value and len(brackets) < limit:
        brackets.append("[" if isinstance(value, list) else "{")
        value = value[0] if isinstance(value, list) else next(iter(value.values()))
    return "".join(brackets) + "..."


class Rejected(Exception):
    """A check failed on one line; the reader turns it into a `LineError`."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.custom_id: str | None = None  # set once the line's custom_id is known
