"""Job priority and pause in dispatch: higher priority first within a minimum share for the
rest, a priority changed while running, a paused job's items held back and given back.

In-process: the real DispatchState over real segment files and real job records written
by the front's registry (ingest/jobs.py), as tests/test_deadline_dispatch.py does; the
clock is the `now` each call is given.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from dispatch_stepped import MT, SteppedDispatch
from test_deadline_dispatch import dispatch_state, handed_jobs, make_job, write_segment

from gpu.dispatch.deadline_order import DEADLINE_RUN
from gpu.dispatch.deadlines import JobDeadlines
from pipeline.core import item_seq
from pipeline.store.job_files import JobFiles
from pipeline.store.job_record import read_job_record
from pipeline.transport import wire

log = logging.getLogger("test")


def test_the_record_keeps_the_priority_and_a_mark_changes_it(data_dir):
    high = make_job(data_dir.root, "high", None, priority=5)
    plain = make_job(data_dir.root, "plain", None)
    assert read_job_record(data_dir.root / "jobs" / "high")["priority"] == 5
    assert "priority" not in read_job_record(data_dir.root / "jobs" / "plain")
    JobFiles(data_dir.root).mark_priority("plain", plain, -2)  # `run.py priority plain -2`
    deadlines = JobDeadlines(data_dir.root, log)
    deadlines.refresh(0.0)  # a dispatch starting now: the record, then the mark over it
    assert deadlines.priorities(np.array([high, plain, plain + 9])).tolist() == [5, -2, 0]


def test_the_higher_priority_job_submitted_second_goes_first(data_dir):
    """Job `low` (priority 0) queued first, job `high` (priority 5) behind it: high's items
    go out first, low still gets every (DEADLINE_RUN + 1)th batch, and priority ranks
    before a deadline."""
    low = make_job(data_dir.root, "low", time.time() + 60)  # a deadline, but priority 0
    high = make_job(data_dir.root, "high", None, priority=5)
    state = dispatch_state(
        data_dir,
        write_segment(data_dir, 1, [(low, 100)]),
        write_segment(data_dir, 2, [(high, 100)]),
    )
    jobs = handed_jobs(state, 8)
    assert jobs == ([high] * DEADLINE_RUN + [low]) * 2
    rest = handed_jobs(state, 100)
    assert sorted(jobs + rest) == [low] * 10 + [high] * 10  # nothing twice, nothing left


def test_a_low_priority_job_keeps_its_minimum_share_under_a_stream_of_high_ones(data_dir):
    """New high-priority jobs keep arriving (a segment each, while batches go out): the
    low-priority job queued first still gets one batch in DEADLINE_RUN + 1, never zero."""
    low = make_job(data_dir.root, "low", None, priority=-1)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(low, 200)]))
    jobs: list[int] = []
    for n in range(10):  # ten high-priority jobs, each arriving before the last is done
        high = make_job(data_dir.root, f"high-{n}", None, priority=10)
        state.deadline_order.deadlines.refresh(float(n + 1), list_anyway=True)
        seg = write_segment(data_dir, 2 + n, [(high, 30)])
        state.add_segment(seg, 0, seg.entries)
        jobs += handed_jobs(state, 4)
    assert jobs.count(low) == len(jobs) // (DEADLINE_RUN + 1)  # its share: 1 in 4
    for start in range(0, len(jobs), DEADLINE_RUN + 1):  # ... in every run of 4
        assert jobs[start : start + DEADLINE_RUN + 1].count(low) == 1


def test_a_priority_changed_while_running_takes_effect_at_the_next_batch(data_dir):
    """Two jobs of priority 0 in one segment, `first` ahead: JOB_CONTROL sets `second` to 3
    (dispatch's `set_priority`, the mark written first): its items go out next."""
    first = make_job(data_dir.root, "first", None)
    second = make_job(data_dir.root, "second", None)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(first, 50), (second, 50)]))
    assert handed_jobs(state, 2) == [first, first]
    state.deadline_order.deadlines.set_priority(second, 3)
    assert handed_jobs(state, 4) == [second] * DEADLINE_RUN + [first]
    state.deadline_order.deadlines.set_priority(second, 0)  # back to the default
    assert handed_jobs(state, 2) == [first, first]


def test_a_paused_jobs_items_wait_and_come_back_once_on_resume(data_dir):
    """Jobs `a` and `b` interleaved in one segment: `a` paused, only `b` goes out and `a`'s
    items still count as waiting; resumed, `a`'s go out, each slot once."""
    a = make_job(data_dir.root, "a", None)
    b = make_job(data_dir.root, "b", None)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(a, 20), (b, 30), (a, 20)]))
    first = state.next_batch("w", "echo", 10, 1 << 20, 0.0)  # in flight when paused
    assert item_seq.job_of(first.items["seq"]).tolist() == [a] * 10
    assert state.pause_job(a) == 30
    assert sum(q.waiting for q in state.queue_depth()) == 60  # a's 30 held + b's 30
    assert handed_jobs(state, 10) == [b, b, b]  # then nothing: a waits
    assert state.next_batch("w", "echo", 10, 1 << 20, 0.0) is None
    assert state.resume_job(a) == 30
    after = handed_jobs(state, 10)
    assert after == [a, a, a]
    taken = np.concatenate([lease.items["slot"] for lease in state.leases()])  # first too
    assert len(np.unique(taken)) == len(taken) == 70


def test_cancelling_a_paused_job_retires_its_held_items(data_dir):
    a = make_job(data_dir.root, "a", None)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(a, 20)]))
    assert state.pause_job(a) == 20
    assert state.cancel_job(a) == 20
    assert len(state.take_outcomes().cancelled) == 20
    assert sum(q.waiting for q in state.queue_depth()) == 0


def test_a_paused_high_priority_job_takes_no_turn_from_the_rest(data_dir):
    """A paused job of priority 5 sits between two jobs of priority 0 in one segment: the
    pick does not aim at its held slots (it would take the job behind it out of turn)."""
    low = make_job(data_dir.root, "low", None)
    high = make_job(data_dir.root, "high", None, priority=5)
    other = make_job(data_dir.root, "other", None)
    segment = write_segment(data_dir, 1, [(low, 30), (high, 30), (other, 30)])
    state = dispatch_state(data_dir, segment)
    assert state.pause_job(high) == 30
    assert handed_jobs(state, 4) == [low, low, low, other]
    assert state.resume_job(high) == 30
    assert handed_jobs(state, 3) == [high, high, high]


def test_the_stage_reads_pause_marks_at_start_and_job_control_while_running(tmp_path):
    """The real stage, stepped with a fake clock. Job A, alone in the older segment, is
    paused (its mark is there when the stage opens, as after a restart): the first request
    holds all of A's 100 items and is given B's. Then JOB_CONTROL (what completion sends for
    `resume` and `priority`) resumes A and sets C, behind B, to priority 4: C goes first,
    A (today's order: the oldest) keeps one batch in DEADLINE_RUN + 1."""
    d = SteppedDispatch(tmp_path)
    try:
        a = make_job(d.data_dir.root, "job-a", None)
        b = make_job(d.data_dir.root, "job-b", None)
        c = make_job(d.data_dir.root, "job-c", None)
        write_segment(d.data_dir, 1, [(a, 100)]).close()
        write_segment(d.data_dir, 2, [(b, 30), (c, 100)]).close()
        JobFiles(d.data_dir.root).mark_paused("job-a", a, time.time_ns())
        d.open()
        worker = d.worker(max_items=10)

        def next_jobs(n: int) -> list[int]:
            jobs = []
            for _ in range(n):
                work = d.work(worker)
                jobs.append(int(item_seq.job_of(work.arrays["items"]["seq"][:1])[0]))
                worker.answer(work)
            return jobs

        assert next_jobs(3) == [b] * 3  # A's all held by the first request
        assert d.stage.stats(d.now)["fabric_paused_items"] == 100
        for job_no, priority in ((a, 0), (c, 4)):
            control = {"job_no": job_no, "paused": False, "priority": priority}
            wire.send(d.completion.to_dispatch, MT.JOB_CONTROL, control)
        d.step()
        assert next_jobs(8) == ([c] * DEADLINE_RUN + [a]) * 2
        assert d.stage.stats(d.now)["fabric_paused_jobs"] == 0
    finally:
        d.close()
