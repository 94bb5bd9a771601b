"""The demand signal and deadline projections, on the real dispatch stage stepped with a fake
clock (tests/dispatch_stepped.py): a backlog, workers with set rates and job deadlines in, the
numbers docs/dispatch.md ("Demand and deadlines") documents out; and the slack order.

Each fake worker takes a batch of 10 items (lane 64) and answers it 0.5 s later on the fake
clock: 20 items/s, 1280 lane-padded tokens/s, 0.05 worker-seconds per item.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
from dispatch_stepped import FAST, LANE, MT, SteppedDispatch
from test_deadline_dispatch import MODEL, dispatch_state, make_job, write_segment

from gpu.dispatch.demand import project_new
from gpu.dispatch.promise import promise
from pipeline.core import item_seq

BATCH = 10
ANSWER_S = 0.5  # each worker's time for a batch: 20 items/s
ITEM_S = ANSWER_S / BATCH  # worker-seconds per item
PATIENT = FAST.replace("session_timeout_s = 2.0", "session_timeout_s = 600.0")  # no reports here


def jobs_of(work) -> list[int]:
    return np.unique(item_seq.job_of(work.arrays["items"]["seq"])).tolist()


def measure(d: SteppedDispatch, workers) -> list[list[int]]:
    """Each worker takes a batch and answers it ANSWER_S later; then the next rescan (the
    demand's refresh). The jobs of each batch."""
    for worker in workers:
        worker.ask()
    works = [d.until(w, MT.WORK) for w in workers]  # all handed out on one fake instant
    d.step(ANSWER_S)
    for worker, work in zip(workers, works, strict=True):
        worker.answer(work)
    for _ in range(20):  # the results reach dispatch on this fake instant
        d.step()
    d.step(1.0)  # past the next rescan: the demand is computed
    return [jobs_of(work) for work in works]


def test_workers_needed_and_projections_follow_the_documented_formulas(tmp_path):
    d = SteppedDispatch(tmp_path, PATIENT).open()
    try:
        workers = [d.worker(max_items=BATCH), d.worker(max_items=BATCH)]
        d.step(1.1)
        idle = d.broker_info()["demand"]["echo"]
        assert idle["workers_needed"] == 0 and idle["items_pending"] == 0  # nothing to do
        assert idle["workers"] == 2 and idle["worker_items_per_s"] is None

        made = d.stage.wall(d.now)  # deadlines on the stage's (fake) clock
        plain = make_job(d.data_dir.root, "plain", None)
        a = make_job(d.data_dir.root, "job-a", made + 14)  # near: needs 3 workers
        b = make_job(d.data_dir.root, "job-b", made + 600)
        write_segment(d.data_dir, 1, [(plain, 600), (a, 400), (b, 100)]).close()
        d.step(1.1)  # the rescan finds the segment and the records
        unmeasured = d.broker_info()
        row = unmeasured["demand"]["echo"]
        assert row["items_pending"] == 1100 and row["tokens_pending"] == 1100 * LANE
        assert row["workers_needed"] == 2  # not measured yet: the workers there are
        assert row["worker_items_per_s"] is None and row["jobs_at_risk"] == 0
        assert unmeasured["deadline_jobs"][str(a)]["measured"] is False

        assert measure(d, workers) == [[a], [a]]  # the earliest deadline first (no rate yet)
        info = d.broker_info()
        row = info["demand"]["echo"]
        assert row["worker_items_per_s"] == 20.0 and row["worker_tokens_per_s"] == 20.0 * LANE
        assert row["items_pending"] == 1080 and row["workers"] == 2
        now = d.stage.wall(d.now)
        left_a = (made + 14) - now
        # all the work within the horizon (300 s): ceil(1080 x 0.05 / 300) = 1. The schedule:
        # A (first in slack order) gets 3/4, plain (the oldest job) 1/4, until A's 380 items
        # (19 worker-seconds) are done: T_A = 19 / 0.75
        a_s = 380 * ITEM_S / 0.75
        expected = math.ceil(a_s / left_a)
        assert 10 < left_a < 12 and expected == 3, left_a
        assert row["workers_needed"] == 3, info["deadline_jobs"]
        stats = d.stage.stats(d.now)
        assert stats["fabric_workers_needed"][("echo",)] == 3
        assert stats["fabric_items_pending"][("echo",)] == 1080
        assert stats["fabric_worker_items_per_second"] == {("echo",): 20.0}  # others: unmeasured
        assert stats["fabric_jobs_at_risk"][("echo",)] == 1

        # projections, 2 workers: A done after T_A / 2; then B gets 3/4 (plain 1/4): T_B =
        # T_A + 5 / 0.75
        proj_a, proj_b = info["deadline_jobs"][str(a)], info["deadline_jobs"][str(b)]
        assert proj_a["at_risk"] is True and proj_a["workers"] == 2
        assert proj_a["projected_finish_s"] == pytest_approx(now + a_s / 2)
        assert proj_a["workers_to_finish"] == 3
        b_s = a_s + 100 * ITEM_S / 0.75
        assert proj_b["projected_finish_s"] == pytest_approx(now + b_s / 2)
        assert proj_b["at_risk"] is False and proj_b["workers_to_finish"] == 1
        assert row["jobs_at_risk"] == 1

        # a job not stored yet (100 lines: 5 s of one worker at 20 items/s), due with A: A
        # has less slack and goes first, then it (3/4, beside plain): T = T_A + 5 / 0.75 = 32 s
        # of work over 2 workers, 16 s: late; 3 workers would make it in A's 11 s
        new = project_new(info, "echo", 100, made + 14, 0, now)
        assert new.finish_s == pytest_approx(now + 32 / 2) and new.at_risk
        assert new.workers_to_finish == 3
        words = promise(info, Counter(echo=100), made + 14, 0)
        assert words.at_risk and words.words.startswith("at risk (projected ")
        assert "with 2 workers; 3 would finish by " in words.words
        roomy = promise(info, Counter(echo=100), made + 3600, 0)
        assert not roomy.at_risk and roomy.words.startswith("on track (projected ")
        assert project_new(info, "sim", 100, made + 14, 0, now) is None  # no rate: no guess
        assert promise(info, Counter(sim=5), made + 14, 0).words.startswith("no projection")

        d.step(20.0)  # A's deadline has passed: counted as LATE_FLOOR_S (10 s) left
        row = d.broker_info()["demand"]["echo"]
        assert row["workers_needed"] == math.ceil(a_s / 10.0) == 3
    finally:
        d.close()


def test_the_slack_order_beats_the_deadline_order_where_they_differ(tmp_path):
    """S (20 items) is due first but is safe; L (300 items, 15 s of one worker's work) is due
    a little later and has less slack: once the rate is measured, L goes first. In deadline
    order (the old rule) S would."""
    d = SteppedDispatch(tmp_path, PATIENT).open()
    try:
        worker = d.worker(max_items=BATCH)
        made = d.stage.wall(d.now)
        long_job = make_job(d.data_dir.root, "long", made + 60)  # slack 60 - 15 = 45 s
        short = make_job(d.data_dir.root, "short", made + 50)  # slack 50 - 1 = 49 s
        write_segment(d.data_dir, 1, [(long_job, 300), (short, 20)]).close()
        d.step(1.1)
        assert measure(d, [worker]) == [[short]]  # no rate yet: the deadline order
        lead = d.stage.state.deadline_order.lead_s
        # each job's whole work (the most seen), so the order does not flip as a job goes
        assert lead == {long_job: pytest_approx(300 * ITEM_S), short: pytest_approx(20 * ITEM_S)}
        following = [jobs_of(d.work(worker)) for _ in range(3)]
        assert following == [[long_job]] * 3
    finally:
        d.close()


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, rel=1e-6)


def test_a_reclaim_does_not_hand_the_slack_order_back_to_the_oldest_job(data_dir):
    """C, D and E wait in one segment, E with less slack than D. A batch of C comes back (a
    worker drained). Once C is done, E still gets 3 batches in 4 and D, the oldest, 1: the
    rewind once moved every later job's place back to the reclaimed slot, so E's pick looked
    like today's order and D got every batch."""
    now = time.time()
    c = make_job(data_dir.root, "c", now + 27)
    d = make_job(data_dir.root, "d", now + 36)
    e = make_job(data_dir.root, "e", now + 27.3)
    state = dispatch_state(data_dir, write_segment(data_dir, 1, [(c, 40), (d, 60), (e, 60)]))
    state.deadline_order.lead_s = {c: 8.0, d: 2.0, e: 4.0}  # slack: C 19, E 23.3, D 34
    first = state.next_batch("w", MODEL, 10, 1 << 20, 0.0)
    assert jobs_of_batch(first) == [c]
    assert state.reclaim(first.batch_id, count_attempt=False) == 10  # the cursor rewinds
    order = [jobs_of_batch(state.next_batch("w", MODEL, 10, 1 << 20, 0.0)) for _ in range(12)]
    assert order == [[c]] * 4 + [[e]] * 3 + [[d]] + [[e]] * 3 + [[d]]


def jobs_of_batch(batch) -> list[int]:
    return np.unique(item_seq.job_of(batch.items["seq"])).tolist()


def test_a_new_job_is_projected_beside_work_without_a_deadline(tmp_path):
    """No job has a deadline: a job submitted now with one would take 3 batches in 4 beside
    the 600 waiting items (the oldest work keeps 1 in 4): 100 lines of 5 worker-seconds take
    5 / 0.75 s of one worker, over 2 workers."""
    d = SteppedDispatch(tmp_path, PATIENT).open()
    try:
        workers = [d.worker(max_items=BATCH), d.worker(max_items=BATCH)]
        plain = make_job(d.data_dir.root, "plain", None)
        write_segment(d.data_dir, 1, [(plain, 620)]).close()
        d.step(1.1)
        measure(d, workers)
        info = d.broker_info()
        assert info["work_jobs"]["echo"]["0"]["items"] == 600  # all of it, as the oldest
        now = d.stage.wall(d.now)
        new = project_new(info, "echo", 100, now + 3600, 0, now)
        assert new.finish_s == pytest_approx(now + 100 * ITEM_S / 0.75 / 2)
    finally:
        d.close()
