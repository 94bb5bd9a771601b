"""A job's state as `status` shows it: completion's counts, with dispatch's items in flight.

The completion stage knows how many of a job's items have a result; only
dispatch knows which are with workers right now. A job with no result yet
is `queued` at completion, but it is `in_progress` as soon as one of its
items is handed to a worker. `status JOB` and `status --watch` ask both and
merge them here, through `pipeline.core.job_states.job_state`:

| completion says | dispatch says              | shown         |
|-----------------|----------------------------|---------------|
| `queued`        | some of its items in flight | `in_progress` |
| `queued`        | none in flight, or no answer | `queued`     |
| anything else   | -                           | unchanged     |

`in_flight` is added to the job's info when dispatch answered.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.job_states import JobState, job_state


def with_in_flight(info: dict[str, Any], broker: dict[str, Any] | None) -> dict[str, Any]:
    """`info` (a JOB_INFO) with dispatch's items in flight for its job, from BROKER_INFO, and
    its deadline projection (`deadline`: docs/dispatch.md, "Demand and deadlines") if any."""
    if broker is None or "job_no" not in info or "in_flight_jobs" not in broker:
        return info
    in_flight = int(broker["in_flight_jobs"].get(str(info["job_no"]), 0))
    merged = {**info, "in_flight": in_flight}
    projection = broker.get("deadline_jobs", {}).get(str(info["job_no"]))
    if projection is not None:  # an unfinished job with a deadline: dispatch's projection
        merged["deadline"] = projection
    if info.get("state") == JobState.QUEUED:  # nothing done, not cancelled by a client
        merged["state"] = str(job_state(info.get("total"), 0, in_flight=in_flight))
    return merged
