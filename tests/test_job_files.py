"""The `jobs/` layout's one home (pipeline/store/job_files.py): its marks, its listing, and the one
fold of `chunks.log` that the front and the completion stage's view share."""

from __future__ import annotations

import pytest

from collector.job_view import JobIndex
from ingest.jobs import JobRegistry
from pipeline.core.errors import IngestError
from pipeline.core.job_states import JobState
from pipeline.store.job_files import ChunkProgress, JobFiles, acknowledged_indexes


def commit(c, first, last, stored, errors=(), final=False, lines=None, ids=None):
    lines = list(range(first, last + 1)) if lines is None else lines
    ids = [f"id-{n}" for n in lines] if ids is None else ids
    return {
        "e": "commit",
        "c": c,
        "first": first,
        "last": last,
        "lines": lines,
        "ids": ids,
        "stored": stored,
        "errors": list(errors),
        "final": final,
    }


def test_only_a_chunks_first_commit_counts_and_the_job_is_whole_once_every_chunk_is_in():
    progress = ChunkProgress()
    assert progress.state == JobState.VALIDATING
    assert progress.apply({"e": "accept", "c": 1, "first": 3, "last": 4, "ns": 5}) is False
    assert progress.apply(commit(1, 3, 4, 1, errors=[[4, "x", "bad", "m"]], final=True))
    assert not progress.all_committed  # chunk 0 is missing
    assert progress.apply(commit(0, 1, 2, 2)) is True
    assert progress.apply(commit(0, 1, 2, 2)) is False  # a retried chunk's second commit
    progress.apply({"e": "state", "state": "queued"})
    assert progress.all_committed and progress.state == JobState.QUEUED
    assert (progress.stored, progress.rejected, progress.committed_chunks) == (3, 1, 2)
    assert progress.error_records() == [[4, "x", "bad", "m"]]
    assert progress.chunks[1].accepted_ns == 5


def test_the_front_and_the_completion_view_read_one_journal_alike(tmp_path):
    registry = JobRegistry(tmp_path)
    job = registry.create("j-1", chunk_lines=2)
    job.accept(0, 1, 2)
    job.commit(0, [1, 2], ["a", "b"], 2, [], final=False)
    registry.touch(job)
    registry.flush()
    index = JobIndex(tmp_path)
    view = index.view("j-1")
    assert view is not None and view.total is None and view.front_state == JobState.VALIDATING
    job.accept(1, 3, 4)
    job.commit(1, [3], ["c"], 1, [[4, "d", "bad_line", "no body"]], final=True)
    registry.touch(job)
    registry.flush()
    view.refresh()  # reads only what was appended since
    again = JobRegistry(tmp_path).get("j-1")  # the front, rebuilt from the journal
    for reader in (job, again):
        assert (reader.stored, reader.rejected, reader.state) == (3, 1, JobState.QUEUED)
        assert reader.all_committed()
    assert (view.stored, view.rejected_count, view.total) == (3, 1, 4)
    assert view.front_state == JobState.QUEUED
    assert view.take_rejected() == [[4, "d", "bad_line", "no body"]]
    assert view.custom_ids([0, 1, 2, 3]) == ["a", "b", "c", "d"]
    assert index.job_id(job.job_no) == "j-1"
    files = JobFiles(tmp_path)
    assert acknowledged_indexes(files.journal_path("j-1")).tolist() == [0, 1, 2]


def test_marks_are_whole_and_a_finished_job_has_no_running_cancel(tmp_path):
    files = JobFiles(tmp_path)
    assert files.names() == [] and files.cancelled_running() == []
    for job_id, job_no in (("a", 1), ("b", 2)):
        files.write_record(job_id, {"job_id": job_id, "job_no": job_no, "created_ns": 1})
        files.mark_cancelled(job_id, job_no, 7)
    (files.root / "c").mkdir()  # a job being created: listed, no record yet
    files.cancel_path("c").write_text("")  # an unreadable mark is handed back as None
    assert files.names() == ["a", "b", "c"] and not files.has_record("c")
    assert files.finished_ns("a") is None
    files.mark_finished("a", 123)
    assert files.is_finished("a") and files.finished_ns("a") == 123
    assert files.is_cancelled("b")
    assert files.cancelled_running() == [
        (files.cancel_path("b"), 2),
        (files.cancel_path("c"), None),
    ]
    assert files.read_record("b")["job_no"] == 2


def test_a_cancel_at_the_deadline_is_marked_so_and_its_job_number_still_read(tmp_path):
    """The mark of a job cancelled at its deadline (it ends `expired`) keeps the job number
    first, where dispatch reads it; a client's cancel, and no mark, are not at the deadline."""
    files = JobFiles(tmp_path)
    for job_id, job_no in (("late", 1), ("asked", 2), ("running", 3)):
        files.write_record(job_id, {"job_id": job_id, "job_no": job_no, "created_ns": 1})
    files.mark_cancelled("late", 1, 7, at_deadline=True)
    files.mark_cancelled("asked", 2, 7)
    assert files.cancel_path("late").read_text() == "1 7 expired\n"
    assert [files.cancelled_at_deadline(j) for j in ("late", "asked", "running")] == [
        True,
        False,
        False,
    ]
    assert files.cancelled_running() == [
        (files.cancel_path("asked"), 2),
        (files.cancel_path("late"), 1),
    ]


@pytest.mark.parametrize("bad", ["../x", "/etc", "", "a\n", ".hidden"])
def test_no_job_id_names_a_path_outside_jobs(tmp_path, bad):
    with pytest.raises(IngestError, match="not allowed"):
        JobFiles(tmp_path).directory(bad)
