"""The completion stage's job index: a job created a moment ago is found at once, cheaply."""

from __future__ import annotations

import orjson

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
    monkeypatch.setattr("collector.job_view.orjson.loads", lambda b: reads.append(b) or real(b))
    assert index.job_id(2) == "b"
    assert len(reads) == 1  # only the new job's job.json was read, not every job again
    assert index.job_id(3) is None
    assert len(reads) == 1  # a miss lists the directory; it reads no job it already knows
