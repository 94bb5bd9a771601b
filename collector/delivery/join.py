"""Join the parts of fan-out lines into one OpenAI Batch line each.

A page with a `part` column (docs/completion.md, "Lines and parts") holds
whole lines: every row of one line has the line's index (line - 1) and its
own part. Each row is rendered as a one-part line would be
(collector/delivery/lines.py), as a dict (not yet JSON: parsing 64 rendered
embeddings back cost more than rendering them), then the rows of one line
are joined, in part order:

| endpoint | joined body |
|----------|-------------|
| `/v1/embeddings` | `data[p]` = part p's embedding object with `"index": p`; `usage` summed |
| `/v1/completions`, `/v1/chat/completions` | `choices[p]` = part p's choice with `"index": p`; `usage` summed |
| any, a line of one part (every `/v1/responses` line) | the part's line as rendered |

`usage` is summed field by field over the parts: a number is added, an
object (`prompt_tokens_details`, `completion_tokens_details`,
`input_tokens_details`, `output_tokens_details`) is summed field by field
the same way, and any other value is part 0's.

The line's `id` and `request_id` are part 0's (they depend only on the
line's index). A line with any part that failed (an error result, or a
result that cannot be rendered) becomes one error line with that part's
code and the message `part P of K: MESSAGE`, P its first failed part. A
line whose rows this client cannot join becomes an `invalid_result` error
line (its own; the rest of the page is delivered). Lines come out in the
order their first row has in the page.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from pipeline.core.item_error_codes import ItemErrorCode

_DUMPS_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY


def join_lines(
    index: np.ndarray,
    part: np.ndarray,
    rendered: list[tuple[int, bool, Any]],
) -> tuple[list[tuple[int, bytes]], list[tuple[int, tuple[str, str]]]]:
    """Join rendered rows into lines.

    `rendered` holds (row, ok, what) for every row: `what` is the row's output line (a dict,
    as lines.py renders it before JSON) when ok, else its (code, message). Returns ([(first row, output line)], [(first row,
    (code, message))]) in page order; the caller renders the error lines."""
    by_row = {row: (ok, what) for row, ok, what in rendered}
    index_l, part_l = index.tolist(), part.tolist()
    groups: dict[int, list[int]] = {}
    for row in range(len(index_l)):
        groups.setdefault(index_l[row], []).append(row)
    out, err = [], []
    for rows in groups.values():
        rows.sort(key=lambda r: part_l[r])
        failed = [r for r in rows if not by_row[r][0]]
        if failed:
            code, message = by_row[failed[0]][1]
            err.append((rows[0], (code, f"part {part_l[failed[0]]} of {len(rows)}: {message}")))
            continue
        lines = [by_row[r][1] for r in rows]
        try:  # a fault of this client's on one line is that line's error, not the page's
            out.append((rows[0], _joined(lines, [part_l[r] for r in rows])))
        except Exception as exc:
            why = f"the client could not join its {len(rows)} part(s) ({type(exc).__name__}: {exc})"
            err.append(
                (rows[0], (ItemErrorCode.INVALID_RESULT, f"{why}; report it with the job id"))
            )
    return out, err


def _joined(lines: list[dict[str, Any]], parts: list[int]) -> bytes:
    first = lines[0]
    if len(lines) == 1:  # a line of one part (a /v1/responses line among them) is as rendered
        return orjson.dumps(first, option=_DUMPS_OPTIONS)
    body = first["response"]["body"]
    usage: dict[str, Any] = {}
    for line in lines:
        _add_usage(usage, line["response"]["body"].get("usage") or {})
    key = "data" if "data" in body else "choices"
    joined = []
    for line, p in zip(lines, parts, strict=True):
        entry = line["response"]["body"][key][0]
        entry["index"] = p
        joined.append(entry)
    body[key] = joined
    if usage:
        body["usage"] = usage
    return orjson.dumps(first, option=_DUMPS_OPTIONS)


def _add_usage(total: dict[str, Any], usage: dict[str, Any]) -> None:
    """Add one part's `usage` into `total`, field by field: numbers summed, objects (the
    `*_tokens_details`) summed the same way, anything else kept as the first part gave it."""
    for key, value in usage.items():
        if isinstance(value, dict):
            _add_usage(total.setdefault(key, {}), value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
        else:
            total.setdefault(key, value)
