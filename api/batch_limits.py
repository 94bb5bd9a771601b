"""A batch's caps over HTTP: its metadata's `fabric_max_error_rate`, `fabric_min_sample`,
`fabric_max_errors` and `fabric_max_tokens_budget` (extensions; pipeline/core/job_limits.py
is their one home) checked at create, sent with its job, and the `errors` of a batch that
ended `failed` because its job passed one.

A job stopped by a limit ends `failed` (pipeline/core/job_states.py), and so does its
batch; its `errors` holds one entry, `{code, line: null, message, param}`: `code` is the
stop's (`error_cap`, `budget_exceeded`), `param` the metadata key of the limit passed, and
`message` says which limit and the numbers at the stop. Its output and error files hold
every line: the results made before the stop, and an error line with that code for each
line not run (docs/http-api.md, "Error and budget caps").
"""

from __future__ import annotations

from typing import Any

from api.errors import invalid
from pipeline.core.job_limits import NAMES, LimitError, limits_of_metadata


def check_limits(metadata: dict[str, str] | None) -> None:
    """400 naming the metadata key of a bad limit; nothing for a good one or none."""
    try:
        limits_of_metadata(metadata)
    except LimitError as exc:
        key = next((meta for meta, _ in NAMES.values() if meta in str(exc)), "metadata")
        raise invalid(str(exc), param=f"metadata.{key}" if key != "metadata" else key) from None


def job_limits(metadata: dict[str, str] | None) -> dict[str, Any]:
    """The limits a batch's job is created with (checked at create; none when bad)."""
    try:
        return limits_of_metadata(metadata).to_record()
    except LimitError:
        return {}


def stopped_errors(info: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The `errors` of a batch whose job (JOB_INFO `info`) a limit stopped, or None."""
    stop = info.get("stopped")
    if not stop:
        return None
    param = NAMES[stop["limit"]][0] if stop["limit"] in NAMES else None
    message = f"the batch was stopped by its limit {param or stop['limit']}: {stop['message']}"
    return [{"code": stop["code"], "line": None, "message": message, "param": param}]
