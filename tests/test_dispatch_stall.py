"""Dispatch's stall watch: a session that reports (renewing its leases) but sends no results
past its stall limit loses its unanswered batches, with an injected `now`."""

from __future__ import annotations

import numpy as np
from test_dispatch_state import segment, state

from gpu.dispatch.stall import StallWatch


def hand(s, watch: StallWatch, session: str, now: float, n: int = 4):
    was_idle = s.session_batches(session) == 0
    batch = s.next_batch(session, "m", n, 10_000, now)
    watch.handed(session, now, was_idle)
    return batch


def test_a_session_that_reports_but_sends_no_results_is_reclaimed_after_its_limit(data_dir):
    seg = segment(data_dir, 1, 12)
    s = state(seg, lease_s=10.0, max_attempts=3)
    watch = StallWatch(multiple=10.0, min_s=5.0)
    watch.registered("w", 0.0)
    first = hand(s, watch, "w", 0.0)
    running = hand(s, watch, "w", 0.0)
    s.answered("w", first.batch_id)
    watch.answered("w", 1.0)  # one batch took 1 s: its limit is 10 x 1 s
    assert watch.limit_s("w") == 10.0
    for now in np.arange(1.0, 12.0, 0.5):  # it goes on reporting: its leases never expire
        held = np.concatenate([first.items, running.items])
        s.report("w", held, seen_batch=running.batch_id, now=float(now))
        assert s.expire(float(now)) == 0
        stalled = watch.find({"w": s.session_batches("w")}, float(now))
        if now <= 11.0:
            assert stalled == [], f"stalled at {now} s, before its limit"
    assert [(x.session, x.limit_s) for x in stalled] == [("w", 10.0)]
    assert watch.is_stalled("w")
    assert s.reclaim_unanswered("w") == 4  # the running batch; the answered one awaits retire
    assert seg.attempts(running.items["slot"].astype(np.int64)).tolist() == [1, 1, 1, 1]
    assert [b.batch_id for b in s.leases("w")] == [first.batch_id]
    assert watch.find({"w": 1}, 30.0) == []  # found once, until results come again
    watch.answered("w", 31.0)
    assert not watch.is_stalled("w")


def test_slow_but_honest_sessions_are_not_stalled(data_dir):
    seg = segment(data_dir, 1, 12)
    s = state(seg)
    watch = StallWatch(multiple=10.0, min_s=5.0)
    watch.registered("new", 0.0)
    hand(s, watch, "new", 0.0)
    assert watch.find({"new": 1}, 4.9) == []  # not measured yet: the floor covers it
    watch.registered("slow", 0.0)
    hand(s, watch, "slow", 0.0)
    watch.answered("slow", 60.0)  # a 60 s batch: its limit is 600 s
    hand(s, watch, "slow", 60.0)
    assert watch.find({"slow": 1}, 600.0) == []
    assert [x.session for x in watch.find({"slow": 1}, 661.0)] == ["slow"]
    idle = StallWatch(multiple=10.0, min_s=5.0)
    idle.registered("idle", 0.0)
    assert idle.find({"idle": 0}, 1000.0) == []  # holding nothing is not a stall
    off = StallWatch(multiple=0.0, min_s=5.0)
    off.registered("w", 0.0)
    assert off.find({"w": 3}, 1e6) == []  # 0 turns the watch off


def test_a_queued_batch_of_a_stalled_session_goes_back_without_an_attempt(data_dir):
    seg = segment(data_dir, 1, 12)
    s = state(seg)
    watch = StallWatch(multiple=10.0, min_s=5.0)
    watch.registered("w", 0.0)
    queued = hand(s, watch, "w", 0.0)
    s.report("w", queued.items, seen_batch=queued.batch_id, now=1.0, queued=[queued.batch_id])
    assert [x.session for x in watch.find({"w": 1}, 6.0)] == ["w"]
    assert s.reclaim_unanswered("w") == 4
    assert seg.attempts(queued.items["slot"].astype(np.int64)).tolist() == [0, 0, 0, 0]
    assert s.next_batch("other", "m", 4, 10_000, 7.0).items["slot"].tolist() == [0, 1, 2, 3]
