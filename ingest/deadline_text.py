"""`submit --deadline`: the text a person gives (a duration, an ISO 8601 time, or seconds
since the epoch) as wall seconds since the epoch, which the job record keeps."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.core.errors import IngestError

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_deadline(text: str, now: float) -> float:
    """`submit --deadline`: a duration from `now` (wall seconds since the epoch: `90s`, `30m`,
    `2h`, `1d`), an ISO 8601 time (`2026-12-01T23:00:00Z`; no zone: UTC) or wall seconds since
    the epoch (`1764630000`). Returns wall seconds since the epoch; IngestError naming the
    text otherwise."""
    text = str(text).strip()
    unit = DURATION_UNITS.get(text[-1:].lower())
    try:
        if unit is not None and text[:-1].replace(".", "", 1).isdigit():
            return now + float(text[:-1]) * unit
        if text.replace(".", "", 1).isdigit():
            return float(text)
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None:
        raise IngestError(
            f"--deadline {text!r} is not understood: give a duration (90s, 30m, 2h, 1d), an "
            "ISO 8601 time (2026-12-01T23:00:00Z) or seconds since the epoch"
        )
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
