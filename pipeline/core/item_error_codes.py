"""The codes of item error results: the one list of what an error line's `error.code` says
when an item (not its input line) ended without a result.

| code             | given by                    | when                                                          |
|------------------|-----------------------------|---------------------------------------------------------------|
| `dead_lettered`  | dispatch                    | reclaimed `max_attempts` times (its worker died, stalled or let the lease expire each time) |
| `corrupt_input`  | dispatch, recovery, `check` | the stored item failed its checksum, or was lost to damage in the input log |
| `cancelled`      | dispatch                    | its job was cancelled by a client before the item ran         |
| `batch_expired`  | completion                  | its job was cancelled at its deadline (`expires_at`) before the item ran |
| `error_cap`      | completion                  | its job passed an error limit (`max_errors`, `max_error_rate`: pipeline/core/job_limits.py) before the item ran |
| `budget_exceeded` | completion                 | its job reached its token budget (`max_tokens`) before the item ran |
| `invalid_result` | completion, results clients | a worker's result was refused, or a stored result cannot be rendered |
| `result_too_large` | completion                | the result is larger than the largest result slot             |
| `item_failed`    | results clients             | a stored error whose text names no code                       |
| `reuse_lost`     | completion                  | a `--reuse` line's stored result was evicted or damaged between the front finding it and completion storing it |

A stored error result is the text `code: message` (collector/completion/intake.py);
the results clients split it into the error line's `code` and `message`
(collector/delivery/lines.py). Lines refused at ingest have codes of their own
(ingest/line_errors.py). The codes are OpenAI's where OpenAI has one
(`batch_expired`).
"""

from __future__ import annotations

from enum import StrEnum


class ItemErrorCode(StrEnum):
    DEAD_LETTERED = "dead_lettered"
    CORRUPT_INPUT = "corrupt_input"
    CANCELLED = "cancelled"
    BATCH_EXPIRED = "batch_expired"
    ERROR_CAP = "error_cap"
    BUDGET_EXCEEDED = "budget_exceeded"
    INVALID_RESULT = "invalid_result"
    RESULT_TOO_LARGE = "result_too_large"
    ITEM_FAILED = "item_failed"
    REUSE_LOST = "reuse_lost"
