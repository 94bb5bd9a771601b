"""Dispatch serves earlier job deadlines first, as a hint that never starves other work.

In-process: the real DispatchState (and, stepped with a fake clock, the real
DispatchStage) over real segment files and real job records written by the
front's registry (ingest/jobs.py); deadlines reach dispatch through the
records only (gpu/dispatch/deadlines.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from conftest import make_batch
from dispatch_stepped import LANE, MODEL, SteppedDispatch

from gpu.dispatch import deadline_order
from gpu.dispatch.deadline_order import DEADLINE_RUN
from gpu.dispatch.deadlines import JobDeadlines
from gpu.dispatch.state import DispatchState
from ingest.jobs import JobRegistry
from pipeline.core import item_seq
from pipeline.store.job_record import read_job_record
from pipeline.store.segment import Segment
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for

log = logging.getLogger("test")


def make_job(root, job_id: str, deadline: float | None, priority: int = 0) -> int:
    """A job created as the front creates one; its job number."""
    registry = JobRegistry(root)
    try:
        return registry.create(job_id, 100, deadline=deadline, priority=priority).job_no
    finally:
        registry.close()


def write_segment(data_dir, segment_id: int, jobs: list[tuple[int, int]]) -> Segment:
    """An input segment of MODEL holding, in order, `n` items of each (job_no, n)."""
    key = SegmentKey(KIND_INPUT, MODEL, 1, LANE)
    total = sum(n for _, n in jobs)
    seg = Segment.create(data_dir.segments, segment_id, key, slot_bytes_for(LANE * 4), 2 * total)
    for job_no, n in jobs:
        _, _, _, counts, tokens = make_batch(np.random.default_rng(job_no), n, 1)
        index = np.arange(n, dtype=np.uint32)
        seq = item_seq.seq_of(job_no, index)
        seg.append(seq, np.full(n, job_no, np.uint64), index, counts, tokens)
    return seg


def dispatch_state(data_dir, *segments: Segment) -> DispatchState:
    deadlines = JobDeadlines(data_dir.root, log)
    deadlines.refresh(0.0)
    state = DispatchState(10.0, 3, deadlines)
    for seg in segments:
        state.add_segment(seg, 0, seg.entries)
    state.loaded()
    return state


def handed_jobs(state: DispatchState, batches: int, size: int = 10) -> list[int]:
    """The job of each batch handed out (each must be one job's items here)."""
    jobs = []
    for _ in range(batches):
        batch = state.next_batch("w", MODEL, size, 1 << 20, 0.0)
        if batch is None:
            break
        owners = np.unique(item_seq.job_of(batch.items["seq"])).tolist()
        assert len(owners) == 1, owners
        jobs.append(owners[0])
    return jobs


def test_the_job_record_keeps_the_deadline_and_old_records_have_none(data_dir):
    later = make_job(data_dir.root, "later", time.time() + 3600)
    plain = make_job(data_dir.root, "plain", None)
    assert read_job_record(data_dir.root / "jobs" / "later")["deadline"] > time.time()
    assert "deadline" not in read_job_record(data_dir.root / "jobs" / "plain")
    deadlines = JobDeadlines(data_dir.root, log)
    deadlines.refresh(0.0)
    answer = deadlines.of(np.array([later, plain, plain + 5]), 0.0)
    assert answer[0] > time.time() and answer[1] == np.inf and np.isnan(answer[2])


@pytest.mark.parametrize("layout", ["one segment", "a segment each"])
def test_the_earlier_deadline_submitted_second_is_handed_out_first(data_dir, layout):
    """Job A (deadline in 2 h) is submitted first, job B (deadline in 10 min) second: B's items
    go out first, whether they sit behind A's in one segment or in a newer segment; A still
    gets one batch in DEADLINE_RUN + 1 while B waits, and everything goes out once."""
    a = make_job(data_dir.root, "job-a", time.time() + 7200)
    b = make_job(data_dir.root, "job-b", time.time() + 600)
    if layout == "one segment":
        segments = [write_segment(data_dir, 1, [(a, 100), (b, 100)])]
    else:
        segments = [write_segment(data_dir, 1, [(a, 100)]), write_segment(data_dir, 2, [(b, 100)])]
    state = dispatch_state(data_dir, *segments)
    jobs = handed_jobs(state, 100)
    assert jobs[: DEADLINE_RUN + 1] == [b] * DEADLINE_RUN + [a]
    last_b = max(i for i, j in enumerate(jobs) if j == b)
    assert jobs[: last_b + 1].count(b) == 10  # B done within its 10 batches plus A's turns
    assert jobs[: last_b + 1].count(a) <= 10 // DEADLINE_RUN + 1
    assert sorted(jobs) == [a] * 10 + [b] * 10  # nothing twice, nothing left
    assert state.deadline_order.batches > 0


def test_a_job_without_a_deadline_is_never_starved(data_dir):
    """A no-deadline job queued first and a long deadline job behind it: the deadline job goes
    first, but the no-deadline job gets every (DEADLINE_RUN + 1)th batch while it waits."""
    plain = make_job(data_dir.root, "plain", None)
    urgent = make_job(data_dir.root, "urgent", time.time() + 60)
    state = dispatch_state(
        data_dir,
        write_segment(data_dir, 1, [(plain, 50)]),
        write_segment(data_dir, 2, [(urgent, 500)]),
    )
    jobs = handed_jobs(state, 20)
    assert jobs[0] == urgent
    assert jobs == ([urgent] * DEADLINE_RUN + [plain]) * 5
    rest = handed_jobs(state, 100)
    assert rest.count(plain) == 0 and rest.count(urgent) == 50 - 15  # plain done, urgent goes on


def test_a_reclaimed_deadline_batch_comes_back_ahead_of_the_cursor(data_dir):
    """A batch of the deadline job taken past the cursor and reclaimed is handed out again
    before the work at the cursor (the rewind reaches the deadline job's place too)."""
    a = make_job(data_dir.root, "job-a", time.time() + 7200)
    b = make_job(data_dir.root, "job-b", time.time() + 600)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(a, 30), (b, 30)]))
    first = state.next_batch("w", MODEL, 10, 1 << 20, 0.0)
    assert item_seq.job_of(first.items["seq"]).tolist() == [b] * 10
    assert state.reclaim(first.batch_id, count_attempt=False) == 10
    again = state.next_batch("w2", MODEL, 10, 1 << 20, 0.0)
    assert again.items["slot"].tolist() == first.items["slot"].tolist()


def test_the_stage_learns_deadlines_from_records_at_start_and_while_running(tmp_path):
    """The real stage, stepped with a fake clock: job A's records and items are there when it
    starts (as after a restart); job B, with the earlier deadline, is created while it runs
    and its segment is found by the rescan. B's items are handed out first from then on."""
    d = SteppedDispatch(tmp_path)
    try:
        a = make_job(d.data_dir.root, "job-a", time.time() + 7200)
        write_segment(d.data_dir, 1, [(a, 200)]).close()
        d.open()
        worker = d.worker(max_items=10)
        first = d.work(worker)
        assert item_seq.job_of(first.arrays["items"]["seq"]).tolist() == [a] * 10
        worker.answer(first)
        b = make_job(d.data_dir.root, "job-b", time.time() + 600)
        write_segment(d.data_dir, 2, [(b, 100)]).close()
        d.step(1.1)  # the rescan: segment 2 and job B's record
        jobs = []
        for _ in range(8):
            work = d.work(worker)
            jobs.append(int(item_seq.job_of(work.arrays["items"]["seq"][:1])[0]))
            worker.answer(work)
        assert jobs == ([b] * DEADLINE_RUN + [a]) * 2
        assert d.stage.stats(d.now)["fabric_deadline_batches_total"] == 2 * DEADLINE_RUN
    finally:
        d.close()


def test_jobs_are_learnt_a_window_at_a_time_and_nothing_is_lost(data_dir, monkeypatch):
    """With a scan window far smaller than the backlog, the deadline job is found once the
    windows reach it (A's batches go out in today's order meanwhile); then it goes first."""
    monkeypatch.setattr(deadline_order, "SCAN_SLOTS", 16)
    a = make_job(data_dir.root, "job-a", time.time() + 7200)
    b = make_job(data_dir.root, "job-b", time.time() + 600)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(a, 200), (b, 50)]))
    jobs = handed_jobs(state, 100)
    found = jobs.index(b)
    assert 0 < found <= 200 // 16 + 1 and jobs[found : found + DEADLINE_RUN] == [b] * DEADLINE_RUN
    assert sorted(jobs) == [a] * 20 + [b] * 5


def test_a_deadline_job_the_cursor_had_passed_is_first_again_after_a_reclaim(data_dir):
    """B's only batch went out from its segment's cursor (so the cursor passed all of B); the
    worker is lost and the batch reclaimed: B is read again and goes out before A's work."""
    plain = make_job(data_dir.root, "plain", None)
    b = make_job(data_dir.root, "job-b", time.time() + 600)
    state = dispatch_state(
        data_dir,
        write_segment(data_dir, 1, [(plain, 50)]),
        write_segment(data_dir, 2, [(b, 10), (plain, 20)]),
    )
    first = state.next_batch("w", MODEL, 10, 1 << 20, 0.0)
    assert first.segment_id == 2 and set(item_seq.job_of(first.items["seq"]).tolist()) == {b}
    assert handed_jobs(state, 1) == [plain]  # the cursor of segment 2 is past B now
    assert state.drop_session("w") == 20
    again = state.next_batch("w2", MODEL, 10, 1 << 20, 0.0)
    assert again.segment_id == 2 and again.items["slot"].tolist() == list(range(10))
