"""A job's state from its facts: the one function every door's state comes from
(pipeline/core/job_states.py `job_state`), and `status`'s merge of dispatch's items in
flight (collector/job_state.py), which goes through it."""

from __future__ import annotations

import pytest

from collector.job_state import with_in_flight
from pipeline.core.job_states import JobState, job_state

S = JobState

# (total, done, facts) -> state
TABLE = [
    ((None, 0, {}), S.VALIDATING),
    ((None, 0, {"cancelled": True}), S.VALIDATING),
    ((3, 0, {}), S.QUEUED),
    ((3, 0, {"in_flight": 2}), S.IN_PROGRESS),
    ((3, 1, {}), S.IN_PROGRESS),
    ((3, 3, {}), S.COMPLETED),
    ((0, 0, {}), S.COMPLETED),  # an empty file's job
    ((3, 1, {"cancelled": True}), S.CANCELLING),
    ((3, 0, {"cancelled": True, "in_flight": 1}), S.CANCELLING),
    ((3, 3, {"cancelled": True}), S.CANCELLED),
    # a cancel at the deadline: the job runs on until its last items are retired
    ((3, 0, {"cancelled": True, "at_deadline": True}), S.QUEUED),
    ((3, 1, {"cancelled": True, "at_deadline": True}), S.IN_PROGRESS),
    ((3, 3, {"cancelled": True, "at_deadline": True}), S.EXPIRED),
    # a deadline word without a cancel mark means nothing
    ((3, 3, {"at_deadline": True}), S.COMPLETED),
    # finished, then its delivered results removed after their retention
    ((3, 1, {"finished": True}), S.EXPIRED),
    ((3, 0, {"finished": True, "cancelled": True}), S.EXPIRED),
    # finished with results still to deliver: not removed, counts as they are
    ((3, 1, {"finished": True, "undelivered": 1}), S.IN_PROGRESS),
    ((3, 3, {"finished": True}), S.COMPLETED),
    ((3, 3, {"finished": True, "cancelled": True}), S.CANCELLED),
]


@pytest.mark.parametrize(("facts", "state"), TABLE)
def test_job_state_of_facts(facts, state):
    total, done, more = facts
    assert job_state(total, done, **more) == state


def test_terminal_states_are_those_with_nothing_left():
    for (total, done, more), state in TABLE:
        if state.terminal:
            assert total is not None and (done >= total or more.get("finished"))


@pytest.mark.parametrize(
    ("state", "in_flight", "shown"),
    [
        (S.QUEUED, 2, S.IN_PROGRESS),
        (S.QUEUED, 0, S.QUEUED),
        (S.IN_PROGRESS, 0, S.IN_PROGRESS),
        (S.CANCELLING, 3, S.CANCELLING),
        (S.COMPLETED, 0, S.COMPLETED),
    ],
)
def test_status_adds_dispatchs_items_in_flight(state, in_flight, shown):
    info = {"job": "j", "job_no": 4, "state": str(state), "total": 3, "completed": 0, "failed": 0}
    broker = {"in_flight_jobs": {"4": in_flight}}
    merged = with_in_flight(info, broker)
    assert merged["state"] == shown and merged["in_flight"] == in_flight
    assert with_in_flight(info, None) == info  # dispatch did not answer: completion's word
