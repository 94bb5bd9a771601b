"""`submit --deadline` and the chunk's `deadline` field: what is accepted, what is refused."""

from __future__ import annotations

import math

import pytest

from ingest.deadline_text import parse_deadline
from ingest.jobs import parse_deadline_field
from pipeline.core.errors import IngestError
from pipeline.store.job_record import record_deadline


@pytest.mark.parametrize(
    "text, expected",
    [
        ("90s", 1090.0),
        ("30m", 1000.0 + 1800),
        ("2h", 1000.0 + 7200),
        ("1.5d", 1000.0 + 1.5 * 86400),
        ("1764630000", 1764630000.0),
        ("2026-12-01T23:00:00Z", 1796166000.0),
        ("2026-12-01T23:00:00", 1796166000.0),  # no zone: UTC
        ("2026-12-01T23:00:00+01:00", 1796166000.0 - 3600),
    ],
)
def test_a_deadline_is_a_duration_an_iso_time_or_epoch_seconds(text, expected):
    assert parse_deadline(text, now=1000.0) == expected


@pytest.mark.parametrize("text", ["soon", "h", "-5s", "", "2h30m", "1e9"])
def test_a_deadline_that_is_not_understood_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(IngestError, match=r"duration .* ISO 8601"):
        parse_deadline(text, now=1000.0)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "2h", True])
def test_the_front_refuses_a_chunk_deadline_that_is_not_a_time(value):
    with pytest.raises(IngestError, match="deadline"):
        parse_deadline_field(value)


def test_a_record_without_a_deadline_or_with_a_bad_one_reads_as_none():
    assert parse_deadline_field(None) is None and parse_deadline_field(5) == 5.0
    assert record_deadline({"job_no": 1}) is None
    assert record_deadline({"deadline": "tomorrow"}) is None
    assert record_deadline({"deadline": 1764630000}) == 1764630000.0


def test_the_api_submits_a_batch_as_a_job_whose_deadline_is_its_expires_at():
    """The batch driver hands the producer SDK the batch's expires_at as the job's deadline
    and its metadata fabric_priority as the job's priority and its limits (api/batch_limits.py)
    as the job's (the front writes them into the job record, where dispatch and completion
    read them)."""
    from api.batch_driver import BatchDriver
    from api.batch_record import BatchRecord

    class Producer:
        def __init__(self) -> None:
            self.calls = []

        def submit_file(
            self, path, job_id, deadline=None, parsed=None, job_priority=0, limits=None, reuse=False
        ):
            self.calls.append((path, job_id, deadline, job_priority, limits))

    producer = Producer()
    driver = BatchDriver(None, None, (None, producer), None)
    try:
        record = BatchRecord(
            id="batch_1",
            owner="me",
            input_file_id="file-1",
            endpoint="/v1/embeddings",
            completion_window="24h",
            created_at=1764540000,
            expires_at=1764630000,
            submit_path="/in.jsonl",
            metadata={"fabric_priority": "3", "fabric_max_errors": "5", "note": "x"},
        )
        driver._submit(record)
        driver._submitting["batch_1"].result(timeout=30)
    finally:
        driver.close()
    assert producer.calls == [("/in.jsonl", "batch_1", 1764630000, 3, {"max_errors": 5})]
