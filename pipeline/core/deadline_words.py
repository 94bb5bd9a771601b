"""What a user hears about a deadline: one sentence from dispatch's projection of a job
(docs/dispatch.md, "Demand and deadlines"), the same at submit, in `status JOB` and on the
dashboard.

| projection | words |
|------------|-------|
| in time | `on track (projected 04:10)` |
| late, with workers | `at risk (projected 07:30 with 3 workers; 5 would finish by 06:00)` |
| late, no worker | `at risk (no worker of echo is connected; 2 would finish by 06:00)` |
| deadline passed | `at risk (projected 07:30 with 3 workers; the deadline 06:00 has passed)` |
| no rate measured | `no projection: no worker of echo has been measured yet (its first results give the rate)` |

Times are the reader's local clock, `HH:MM`, with the date when it is not today.
"""

from __future__ import annotations

import time
from typing import Any


def clock(wall_s: float, now_s: float) -> str:
    """`HH:MM` local time, with the date in front when it is not today's."""
    when, today = time.localtime(wall_s), time.localtime(now_s)
    if when[:3] == today[:3]:
        return time.strftime("%H:%M", when)
    return time.strftime("%Y-%m-%d %H:%M", when)


def deadline_words(row: dict[str, Any], now_s: float) -> str:
    """The sentence for one projection (`deadline_jobs` of dispatch's status answer, or a
    submit-time one of the same keys: model, deadline_s, projected_finish_s, measured,
    at_risk, workers, workers_to_finish)."""
    model = row["model"]
    if not row["measured"]:
        return (
            f"no projection: no worker of {model} has been measured yet (its first results "
            "give the rate)"
        )
    deadline = clock(row["deadline_s"], now_s)
    finish = row["projected_finish_s"]
    if not row["at_risk"]:
        return f"on track (projected {clock(finish, now_s)})"
    need = row["workers_to_finish"]
    would = (
        f"{need} would finish by {deadline}"
        if need is not None
        else f"the deadline {deadline} has passed"
    )
    if finish is None:
        return f"at risk (no worker of {model} is connected; {would})"
    workers = row["workers"]
    plural = "s" if workers != 1 else ""
    return f"at risk (projected {clock(finish, now_s)} with {workers} worker{plural}; {would})"
