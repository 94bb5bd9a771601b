"""Leases and timeouts run on the monotonic clock: stepping the wall clock changes nothing.

The dispatch state takes `now` (time.monotonic() in the stage) on every call;
here the wall clock (time.time, time.time_ns) jumps hours forward and back on
every read while `now` advances steadily, and a lease still expires exactly at
`lease_s` past its last renewal, never earlier or later. The heartbeat's
`up_s` is a duration too. Wall time stays where it is written to files as a
timestamp (created_ns, finished, sealed_ns) and read back across restarts.
"""

from __future__ import annotations

import ast
import itertools
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from broker import free_port
from conftest import make_batch, wait_for

from gpu.dispatch.state import DispatchState
from pipeline import wire
from pipeline.segment import Segment
from pipeline.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.supervisor import Heartbeat

ROOT = Path(__file__).resolve().parents[1]
HOURS = 3600.0
LEASE_S = 30.0


@pytest.fixture
def jumpy_wall_clock(monkeypatch):
    """time.time / time.time_ns step +9 h, -7 h, +30 days, -1 year, ... on every read."""
    real = time.time()
    steps = itertools.cycle([9 * HOURS, -7 * HOURS, 30 * 24 * HOURS, -365 * 24 * HOURS, 0.0])
    reads = []

    def fake_time() -> float:
        reads.append(1)
        return real + next(steps)

    monkeypatch.setattr(time, "time", fake_time)
    monkeypatch.setattr(time, "time_ns", lambda: int(fake_time() * 1e9))
    return reads


def dispatch_state(data_dir) -> tuple[DispatchState, Segment]:
    key = SegmentKey(KIND_INPUT, "m", 1, 64)
    seg = Segment.create(data_dir.segments, 1, key, slot_bytes_for(64 * 4), 1000)
    seg.append(*make_batch(np.random.default_rng(7), 8, 1))
    state = DispatchState(lease_s=LEASE_S, max_attempts=5)
    state.add_segment(seg, 0, seg.entries)
    state.loaded()
    return state, seg


def test_a_lease_expires_exactly_lease_s_after_its_renewal_whatever_the_wall_clock(
    data_dir, jumpy_wall_clock
):
    state, seg = dispatch_state(data_dir)
    t0 = 1000.0  # monotonic seconds, as the stage passes them
    batch = state.next_batch("w", "m", 4, 10_000, now=t0)
    assert batch.deadline_s == t0 + LEASE_S
    for now in np.arange(t0, t0 + LEASE_S, 0.5):  # the wall clock jumps on every call
        state.report("w", batch.items, batch.batch_id, now=t0)  # renews from t0, not from wall
        assert state.expire(now=float(now)) == 0, f"expired early at +{now - t0} s"
    assert state.expire(now=t0 + LEASE_S) == 0  # the deadline itself is still inside the lease
    assert state.expire(now=t0 + LEASE_S + 0.001) == 4  # and not one moment later
    seg.close()


def test_renewals_move_the_deadline_by_now_only(data_dir, jumpy_wall_clock):
    state, seg = dispatch_state(data_dir)
    batch = state.next_batch("w", "m", 8, 10_000, now=0.0)
    for renewal in (10.0, 20.0, 29.0):
        assert state.renew("w", now=renewal) == 1
        assert state.lease(batch.batch_id).deadline_s == renewal + LEASE_S
        assert state.expire(now=renewal + LEASE_S - 0.001) == 0
    assert state.expire(now=29.0 + LEASE_S + 0.001) == 8
    assert len(state.leases()) == 0
    seg.close()


def test_nothing_expires_before_loading_even_if_the_wall_clock_leaps_a_year(
    data_dir, jumpy_wall_clock
):
    _, seg = dispatch_state(data_dir)
    fresh = DispatchState(lease_s=LEASE_S, max_attempts=5)
    fresh.add_segment(seg, 0, seg.entries)
    fresh.next_batch("w", "m", 2, 10_000, now=0.0)
    assert fresh.expire(now=10 * LEASE_S) == 0  # invariant 9: no timeouts until loaded
    fresh.loaded()
    assert fresh.expire(now=10 * LEASE_S) == 2
    seg.close()


def test_the_dispatch_state_never_reads_the_wall_clock(data_dir, jumpy_wall_clock):
    state, seg = dispatch_state(data_dir)
    jumpy_wall_clock.clear()  # the segment's created_ns is a timestamp: fine
    batch = state.next_batch("w", "m", 4, 10_000, now=0.0)
    state.report("w", batch.items, batch.batch_id, now=1.0)
    state.expire(now=2.0)
    state.reclaim(batch.batch_id, count_attempt=True)
    assert jumpy_wall_clock == []  # not one read of time.time or time.time_ns
    seg.close()


def test_heartbeat_up_s_is_a_monotonic_duration(jumpy_wall_clock):
    address = f"tcp://127.0.0.1:{free_port()}"
    beat = Heartbeat(address, epoch=7)
    beat.recovered = True
    beat.start()
    context = zmq.Context()
    ping = context.socket(zmq.DEALER)
    ping.setsockopt(zmq.LINGER, 0)
    ping.connect(address)
    try:

        def pong():
            wire.send(ping, wire.MessageType.PING, {})
            return wire.recv(ping, 500)

        answer = wait_for(pong, "the heartbeat to answer", timeout_s=10)
        assert answer.meta["epoch"] == 7
        assert 0 <= answer.meta["up_s"] < 60  # a wall-clock jump of hours does not show
    finally:
        ping.close(0)
        context.term()
        beat.stop()


# Calls of time.time() / time.time_ns() allowed in the modules that run leases, deadlines and
# timeouts: each one is a timestamp written somewhere or an id, never compared with a deadline.
WALL_CLOCK_ALLOWED = {
    "gpu/dispatch/batch_ids.py": "batch ids start from wall-clock microseconds",
    "gpu/dispatch/item_errors.py": "dead-letter events (timestamps for people)",
    "gpu/dispatch/work_finder.py": "when queued slots arrived (the queue's age, a timestamp)",
    "pipeline/supervisor.py": "the broker epoch (an id, shared by every stage)",
    "collector/completion_stage.py": "jobs/<job>/finished: when the job finished, for retention",
}
TIMED_MODULES = [
    "gpu/dispatch/state.py",
    "gpu/dispatch/stage.py",
    "gpu/dispatch/batch_ids.py",
    "gpu/dispatch/item_errors.py",
    "gpu/dispatch/work_finder.py",
    "gpu/worker.py",
    "ingest/front.py",
    "ingest/tokenizer_stage.py",
    "router/writer.py",
    "router/router.py",
    "pipeline/supervisor.py",
    "pipeline/segment_log.py",
    "collector/completion_stage.py",
    "collector/client.py",
]


def wall_clock_calls(path: Path) -> list[int]:
    """Line numbers of time.time() and time.time_ns() calls in a module."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("time", "time_ns")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    ]


@pytest.mark.parametrize("module", TIMED_MODULES)
def test_modules_that_time_things_read_the_wall_clock_only_for_timestamps(module):
    calls = wall_clock_calls(ROOT / module)
    if module not in WALL_CLOCK_ALLOWED:
        assert calls == [], f"{module} reads the wall clock at lines {calls}: use time.monotonic()"
