"""The arithmetic of a job's caps (pipeline/core/job_limits.py), stepped line by line."""

from __future__ import annotations

import pytest

from pipeline.core.job_limits import (
    DEFAULT_MIN_SAMPLE,
    JobLimits,
    LimitError,
    Stop,
    limits_of_flags,
    limits_of_metadata,
    record_limits,
)


def first_stop(limits: JobLimits, outcomes: str, tokens_per_line: int = 0):
    """Feed `outcomes` ("e": an error, "." a result) one line at a time; (lines done at the
    stop, the stop), or (None, None)."""
    failed = 0
    for done, outcome in enumerate(outcomes, start=1):
        failed += outcome == "e"
        stop = limits.passed(done, failed, done * tokens_per_line)
        if stop is not None:
            return done, stop
    return None, None


def test_a_rate_cap_waits_for_its_minimum_sample():
    done, stop = first_stop(JobLimits(max_error_rate=0.5), "e" * 100)
    assert done == DEFAULT_MIN_SAMPLE == 20
    assert (stop.code, stop.limit) == ("error_cap", "max_error_rate")
    assert "20 errors of 20 lines (100.0%)" in stop.message


def test_a_rate_at_the_cap_does_not_stop_and_one_more_error_does():
    limits = JobLimits(max_error_rate=0.5, min_sample=4)
    assert first_stop(limits, ".e.e" * 50) == (None, None)  # exactly half: not more than
    done, _ = first_stop(limits, "e.e.e")
    assert done == 5  # 3 of 5 > 0.5


def test_max_errors_counts_errors_not_lines():
    done, stop = first_stop(JobLimits(max_errors=3), ".e" * 10)
    assert (done, stop.limit) == (8, "max_errors")  # the 4th error
    assert first_stop(JobLimits(max_errors=0), "..........") == (None, None)


def test_a_token_budget_stops_when_reached():
    done, stop = first_stop(JobLimits(max_tokens=95), "." * 20, tokens_per_line=10)
    assert (done, stop.code, stop.limit) == (10, "budget_exceeded", "max_tokens")
    assert stop.message.startswith("100 tokens reached max_tokens 95")


def test_no_limits_never_stop_and_record_nothing():
    assert not JobLimits().any and JobLimits().to_record() == {}
    assert first_stop(JobLimits(), "e" * 1000, 100) == (None, None)


def test_a_stop_survives_its_cancel_mark():
    stop = JobLimits(max_errors=0).passed(1, 1, 0)
    assert Stop.from_mark(stop.mark_text().split()) == stop
    assert Stop.from_mark(["expired"]) is None and Stop.from_mark([]) is None


def test_limits_from_their_doors():
    assert limits_of_metadata({"fabric_max_error_rate": "0.25", "other": "x"}) == JobLimits(
        max_error_rate=0.25
    )
    record = limits_of_flags({"max_error_rate": "0.1", "min_sample": "5"}).to_record()
    assert record == {"max_error_rate": 0.1, "min_sample": 5}
    assert record_limits({"limits": record}) == JobLimits(max_error_rate=0.1, min_sample=5)
    assert JobLimits(max_tokens=9).to_record() == {"max_tokens": 9}  # no sample without a rate
    assert record_limits({"limits": "nonsense"}) == JobLimits()


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({"fabric_max_error_rate": "2"}, "metadata.fabric_max_error_rate '2'"),
        ({"fabric_max_errors": "-1"}, "metadata.fabric_max_errors '-1'"),
        ({"fabric_min_sample": "0"}, "metadata.fabric_min_sample '0'"),
        ({"fabric_max_tokens_budget": "1e9"}, "metadata.fabric_max_tokens_budget '1e9'"),
    ],
)
def test_a_bad_limit_names_its_key_and_value(metadata, named):
    with pytest.raises(LimitError, match=named.replace(".", r"\.")):
        limits_of_metadata(metadata)


def test_a_worker_seconds_budget_stops_when_reached():
    limits = JobLimits(max_worker_s=2.5)
    assert limits.passed(10, 0, 0, worker_s=2.4) is None
    stop = limits.passed(11, 0, 0, worker_s=2.5)
    assert (stop.code, stop.limit) == ("budget_exceeded", "max_worker_s")
    assert limits_of_metadata({"fabric_max_worker_seconds": "0.5"}) == JobLimits(max_worker_s=0.5)
