"""The completion stage's job index: a job created a moment ago is found at once, cheaply."""

from __future__ import annotations

import orjson
import pytest

from collector.job_view import JobIndex


def make_job(root, job_id: str, job_no: int) -> None:
    directory = root / "jobs" / job_id
    directory.mkdir(parents=True)
    (directory / "job.json").write_bytes(
        orjson.dumps({"job_id": job_id, "job_no": job_no, "created_ns": 1, "chunk_lines": 10})
    )


def test_a_job_created_after_a_miss_is_found_at_once_and_read_once(tmp_path, monkeypatch):
    make_job(tmp_path, "a", 1)
    index = JobIndex(tmp_path)
    assert index.job_id(1) == "a"
    assert index.job_id(2) is None
    make_job(tmp_path, "b", 2)  # results for it can arrive within the same millisecond
    reads = []
    real = orjson.loads
    monkeypatch.setattr(
        "pipeline.store.job_record.orjson.loads", lambda b: reads.append(b) or real(b)
    )
    assert index.job_id(2) == "b"
    assert len(reads) == 1  # only the new job's job.json was read, not every job again
    assert index.job_id(3) is None
    assert len(reads) == 1  # a miss lists the directory; it reads no job it already knows


def test_a_changed_job_number_is_caught_by_the_record_checksum_and_the_job_refused(tmp_path):
    from ingest.job_check import check_job_records
    from ingest.jobs import JobRegistry
    from pipeline.store.job_record import JobRecordError

    registry = JobRegistry(tmp_path)
    registry.create("first", 10)
    registry.create("second", 10)
    registry.close()
    path = tmp_path / "jobs" / "second" / "job.json"
    path.write_bytes(path.read_bytes().replace(b'"job_no":2', b'"job_no":1'))  # still JSON
    index = JobIndex(tmp_path)
    assert index.job_id(2) is None  # its record no longer says its number
    assert index.job_id(1) == "first"  # never "second": its results stay its own
    assert index.view("second") is None and "checksum" in index.refused["second"]
    findings = check_job_records(tmp_path)
    assert [(f.code, f.path.parent.name) for f in findings] == [("bad-job-record", "second")]
    with pytest.raises(JobRecordError, match="checksum mismatch"):
        JobRegistry(tmp_path).get("second")


def test_two_records_claiming_one_job_number_are_both_refused(tmp_path):
    from ingest.job_check import check_job_records

    make_job(tmp_path, "a", 7)  # version 1 records: no checksum to catch a changed number
    make_job(tmp_path, "b", 7)
    index = JobIndex(tmp_path)
    assert index.job_id(7) is None
    assert index.view("a") is None and index.view("b") is None
    assert "claimed by" in index.refused["a"]
    codes = [f.code for f in check_job_records(tmp_path)]
    assert codes == ["duplicate-job-number"]
