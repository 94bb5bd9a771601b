"""Rejected lines as a few compact arrays, for answers that must fit whatever a chunk held.

A chunk's rejected lines used to travel as a JSON list in a message's
metadata, which has a 1 MiB limit: a chunk of a few thousand bad lines could
not be answered at all. They travel as array frames instead (no metadata
limit applies to those), and the message each line carries is split into
the part that names the line, rebuilt on arrival, and the reason, kept once
in a table of distinct reasons: 20,000 lines naming an endpoint their model
does not serve cost about 20 bytes each.

| array              | dtype | meaning                                                      |
|--------------------|-------|--------------------------------------------------------------|
| err_line           | <u4   | line number of each rejected line, in order                  |
| err_code           | <u2   | index into `err_codes`                                       |
| err_reason         | <u4   | index into `err_reasons`                                     |
| err_prefixed       | u1    | 1: the message is "line N (custom_id X): " + the reason; 0: the reason is the whole message |
| err_has_id         | u1    | 1: the line had a readable custom_id                         |
| err_ids            | u1    | the custom_ids, UTF-8, back to back ("" where it had none)   |
| err_ids_offsets    | <i8   | n + 1 offsets into `err_ids`                                 |
| err_codes          | u1    | orjson list of the distinct codes (`ingest.line_errors.CODES`) |
| err_reasons        | u1    | orjson list of the distinct reasons                          |

The answer to a chunk is therefore at most the size of the chunk's own
custom_ids plus about 20 bytes a line and one copy of each distinct reason.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import orjson

from ingest.line_errors import LineError
from pipeline.core.errors import WireError
from pipeline.core.ragged import offsets_of, offsets_problem

ARRAYS = (
    "err_line",
    "err_code",
    "err_reason",
    "err_prefixed",
    "err_has_id",
    "err_ids",
    "err_ids_offsets",
    "err_codes",
    "err_reasons",
)


def _prefix(line: int, custom_id: str | None) -> str:
    """What `LineError.at` puts before the reason (kept in step with it by a round-trip test)."""
    return LineError.at(line, custom_id, "", "").message


def errors_to_wire(errors: Iterable[LineError]) -> dict[str, np.ndarray]:
    """The arrays above for `errors` (in the order given)."""
    errors = list(errors)
    n = len(errors)
    lines = np.fromiter((e.line for e in errors), np.uint32, n)
    codes = np.zeros(n, np.uint16)
    reason_index = np.zeros(n, np.uint32)
    prefixed = np.zeros(n, np.uint8)
    has_id = np.fromiter((e.custom_id is not None for e in errors), np.uint8, n)
    reasons: dict[str, int] = {}
    code_index: dict[str, int] = {}
    for i, error in enumerate(errors):
        codes[i] = code_index.setdefault(error.code, len(code_index))
        prefix = _prefix(error.line, error.custom_id)
        reason = error.message
        if reason.startswith(prefix):
            reason, prefixed[i] = reason[len(prefix) :], 1
        reason_index[i] = reasons.setdefault(reason, len(reasons))
    encoded = [(e.custom_id or "").encode() for e in errors]
    offsets = offsets_of(np.fromiter(map(len, encoded), np.int64, n))
    return {
        "err_line": lines.astype("<u4", copy=False),
        "err_code": codes.astype("<u2", copy=False),
        "err_reason": reason_index.astype("<u4", copy=False),
        "err_prefixed": prefixed,
        "err_has_id": has_id,
        "err_ids": np.frombuffer(b"".join(encoded), np.uint8),
        "err_ids_offsets": offsets.astype("<i8", copy=False),
        "err_codes": np.frombuffer(orjson.dumps(list(code_index)), np.uint8),
        "err_reasons": np.frombuffer(orjson.dumps(list(reasons)), np.uint8),
    }


def errors_from_wire(arrays: dict[str, np.ndarray]) -> list[LineError]:
    """The LineErrors of a message's arrays; [] if it has none; WireError if they disagree."""
    if "err_line" not in arrays:
        return []
    missing = [name for name in ARRAYS if name not in arrays]
    if missing:
        raise WireError(f"rejected lines: the message lacks arrays {missing}")
    n = len(arrays["err_line"])
    for name in ("err_code", "err_reason", "err_prefixed", "err_has_id"):
        if arrays[name].ndim != 1 or len(arrays[name]) != n:
            raise WireError(f"rejected lines: {name} has {arrays[name].shape}, not {n} entries")
    blob = arrays["err_ids"].tobytes()
    problem = offsets_problem(arrays["err_ids_offsets"], n, len(blob))
    if problem is not None:
        raise WireError(f"rejected lines: err_ids_offsets into {len(blob)} bytes: {problem}")
    offsets = arrays["err_ids_offsets"].astype(np.int64)
    try:
        reasons = [str(r) for r in orjson.loads(arrays["err_reasons"].tobytes())]
        code_names = [str(c) for c in orjson.loads(arrays["err_codes"].tobytes())]
        lines = arrays["err_line"].tolist()
        codes = arrays["err_code"].tolist()
        reason_index = arrays["err_reason"].tolist()
        if n and (max(codes) >= len(code_names) or max(reason_index) >= len(reasons)):
            raise WireError("rejected lines: a code or reason index is out of range")
        has_id, prefixed = arrays["err_has_id"].tolist(), arrays["err_prefixed"].tolist()
        bounds = zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
        errors = []
        for i, (start, stop) in enumerate(bounds):
            custom_id = blob[start:stop].decode() if has_id[i] else None
            reason = reasons[reason_index[i]]
            if prefixed[i]:
                errors.append(LineError.at(lines[i], custom_id, code_names[codes[i]], reason))
            else:
                errors.append(LineError(lines[i], custom_id, code_names[codes[i]], reason))
        return errors
    except (UnicodeDecodeError, orjson.JSONDecodeError, TypeError) as exc:
        raise WireError(f"rejected lines are malformed: {type(exc).__name__}: {exc}") from None
