"""A job's limits: the caps that stop a broken or costly job, and the arithmetic of passing one.

| limit (record key) | CLI flag              | HTTP metadata                | stops the job when                                  | code              |
|--------------------|-----------------------|------------------------------|-----------------------------------------------------|-------------------|
| `max_error_rate`   | `--max-error-rate R`  | `fabric_max_error_rate`      | at least `min_sample` lines have a result or an error, and more than R (0..1) of them failed | `error_cap` |
| `min_sample`       | `--min-sample N`      | `fabric_min_sample`          | (the sample the rate waits for; default `DEFAULT_MIN_SAMPLE`, 20) | |
| `max_errors`       | `--max-errors N`      | `fabric_max_errors`          | more than N lines have an error result             | `error_cap`       |
| `max_tokens`       | `--max-tokens-budget N` | `fabric_max_tokens_budget` | the job's prompt + generated tokens reach N         | `budget_exceeded` |
| `max_worker_s`     | `--max-worker-seconds S` | `fabric_max_worker_seconds` | the engine time its results took reaches S seconds (collector/completion/worker_time.py) | `budget_exceeded` |

A job's limits travel with its first chunk (ingest/submit_client.py) into its
record (pipeline/store/job_record.py, field `limits`), and completion checks
them each time the job is given results (collector/completion/caps.py). Error
results of every kind count as errors (a worker's, a refused result, a line
refused at ingest). A job that passes a limit is stopped as a cancel is: the
lines in flight finish, every line not yet run gets an error line with the
code above (pipeline/core/item_error_codes.py), and the job ends `failed`.
Results already made stay deliverable.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.core.errors import FabricError
from pipeline.core.item_error_codes import ItemErrorCode

DEFAULT_MIN_SAMPLE = 20  # lines done before a rate cap may stop a job
# record key -> the HTTP metadata key and the CLI flag that set it
NAMES = {
    "max_error_rate": ("fabric_max_error_rate", "--max-error-rate"),
    "min_sample": ("fabric_min_sample", "--min-sample"),
    "max_errors": ("fabric_max_errors", "--max-errors"),
    "max_tokens": ("fabric_max_tokens_budget", "--max-tokens-budget"),
    "max_worker_s": ("fabric_max_worker_seconds", "--max-worker-seconds"),
}
FRACTIONAL = ("max_error_rate", "max_worker_s")  # the limits that need not be whole numbers


class LimitError(FabricError, ValueError):
    """A limit that is not a number in its range (the message names it and the fix)."""


@dataclass(frozen=True)
class Stop:
    """Why a job was stopped: its `code`, the `limit` passed, and `message`, with the numbers."""

    code: str
    limit: str
    message: str

    def mark_text(self) -> str:
        """How the cancel mark records it (pipeline/store/job_files.py): code, limit, message."""
        return f"{self.code} {self.limit} {self.message}"

    @classmethod
    def from_mark(cls, words: list[str]) -> Stop | None:
        """The stop a cancel mark's words after its time record, or None (not a cap's)."""
        if len(words) < 2 or words[0] not in (
            ItemErrorCode.ERROR_CAP,
            ItemErrorCode.BUDGET_EXCEEDED,
        ):
            return None
        return cls(words[0], words[1], " ".join(words[2:]))


@dataclass(frozen=True)
class JobLimits:
    max_error_rate: float | None = None
    min_sample: int = DEFAULT_MIN_SAMPLE
    max_errors: int | None = None
    max_tokens: int | None = None
    max_worker_s: float | None = None

    @property
    def any(self) -> bool:
        caps = (self.max_error_rate, self.max_errors, self.max_tokens, self.max_worker_s)
        return caps != (None, None, None, None)

    def to_record(self) -> dict[str, Any]:
        """The record's `limits` (only the limits set, `min_sample` with a rate; {} when there
        are none)."""
        if not self.any:
            return {}
        record = {k: v for k, v in asdict(self).items() if v is not None}
        if self.max_error_rate is None:
            del record["min_sample"]  # the rate's sample: nothing without a rate
        return record

    def passed(self, done: int, failed: int, tokens: int, worker_s: float = 0.0) -> Stop | None:
        """The limit the job has passed with `done` lines with a result or an error, `failed`
        of them errors, `tokens` prompt + generated tokens and `worker_s` engine seconds, or
        None."""
        if self.max_errors is not None and failed > self.max_errors:
            return Stop(
                ItemErrorCode.ERROR_CAP,
                "max_errors",
                f"{failed} errors passed max_errors {self.max_errors} ({done} lines done)",
            )
        rate = self.max_error_rate
        if rate is not None and done >= self.min_sample and failed > rate * done:
            return Stop(
                ItemErrorCode.ERROR_CAP,
                "max_error_rate",
                f"{failed} errors of {done} lines ({failed / done:.1%}) passed max_error_rate "
                f"{rate:g} (min sample {self.min_sample})",
            )
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return Stop(
                ItemErrorCode.BUDGET_EXCEEDED,
                "max_tokens",
                f"{tokens} tokens reached max_tokens {self.max_tokens} ({done} lines done)",
            )
        if self.max_worker_s is not None and worker_s >= self.max_worker_s:
            return Stop(
                ItemErrorCode.BUDGET_EXCEEDED,
                "max_worker_s",
                f"{worker_s:.1f} worker-seconds reached max_worker_s {self.max_worker_s:g} "
                f"({done} lines done)",
            )
        return None


def _number(value: Any, name: str, where: str, integer: bool) -> float | int:
    text = str(value).strip()
    try:
        number: float | int = int(text) if integer else float(text)
    except ValueError:
        number = math.nan
    bad = isinstance(value, bool) or not math.isfinite(number) or number < 0
    if name == "max_error_rate" and not bad:
        bad = number > 1
    if name == "min_sample" and not bad:
        bad = number < 1
    if bad:
        kinds = {"max_error_rate": "a share from 0 to 1", "max_worker_s": "a number of seconds"}
        kind = kinds.get(name, "a whole number")
        low = " of at least 1" if name == "min_sample" else (" (0 or more)" if integer else "")
        raise LimitError(f"{where} {value!r} is not {kind}{low}: give e.g. {_EXAMPLE[name]}")
    return number


_EXAMPLE = {
    "max_error_rate": "0.5",
    "min_sample": "20",
    "max_errors": "100",
    "max_tokens": "1000000",
}


def limits_from(values: dict[str, Any], label: dict[str, str] | None = None) -> JobLimits:
    """JobLimits from `values` (record keys -> numbers or their text; None: not set).
    LimitError names the bad one by `label[key]` (where it came from; default `limits.key`)."""
    known: dict[str, Any] = {}
    for key, value in (values or {}).items():
        if key not in NAMES or value is None:
            continue
        where = (label or {}).get(key, f"limits.{key}")
        known[key] = _number(value, key, where, integer=key not in FRACTIONAL)
    return JobLimits(**known)


def limits_of_metadata(metadata: dict[str, str] | None) -> JobLimits:
    """A batch's limits from its HTTP metadata (`fabric_max_error_rate` and the others);
    LimitError names the bad key."""
    metadata = metadata or {}
    values = {key: metadata.get(meta) for key, (meta, _) in NAMES.items()}
    return limits_from(values, {key: f"metadata.{meta}" for key, (meta, _) in NAMES.items()})


def limits_of_flags(values: dict[str, Any]) -> JobLimits:
    """A job's limits from the CLI's flags (record keys -> the flags' values)."""
    return limits_from(values, {key: flag for key, (_, flag) in NAMES.items()})


def record_limits(meta: dict[str, Any]) -> JobLimits:
    """The limits of a verified job record (none when it has no valid `limits`)."""
    try:
        return limits_from(meta.get("limits") or {})
    except (LimitError, AttributeError):
        return JobLimits()
