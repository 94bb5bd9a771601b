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
from pipeline.process.heartbeat import Heartbeat
from pipeline.store.segment import Segment
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.transport import wire

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


# Every product module is checked (PRODUCT_FOLDERS, walked): a call of time.time() or
# time.time_ns() is allowed only in these modules, each for a timestamp written somewhere, an
# id, or the age of such a timestamp, never for a deadline or a timeout. The list is exact: a
# module that stops reading the wall clock must leave it too.
PRODUCT_FOLDERS = ("pipeline", "config", "router", "ingest", "gpu", "collector", "assembly")
WALL_CLOCK_ALLOWED = {
    "pipeline/transport/ring.py": "the ring header's created_ns (a timestamp for people)",
    "pipeline/store/scan.py": "sealed_ns written when recovery seals a segment",
    "pipeline/store/segment.py": "a segment's created_ns and sealed_ns",
    "pipeline/process/stage_restarts.py": "seconds until a restart_at_ns of the supervisor's report",
    "pipeline/process/supervisor.py": "the broker epoch (an id shared by every stage); report times",
    "ingest/jobs.py": "a job's created_ns and its chunks' ns",
    "gpu/dispatch/batch_ids.py": "batch ids start from wall-clock microseconds",
    "gpu/dispatch/item_errors.py": "dead-letter events (timestamps for people)",
    "gpu/dispatch/work_finder.py": "when queued slots arrived (the queue's age, a timestamp)",
    "collector/job_view.py": "the cancel mark's time",
    "collector/segments.py": "retention: a job finished that long ago (its finished mark)",
    "collector/status_sources.py": "when a dashboard snapshot was taken",
    "collector/status_view.py": "a job's age from its created_ns",
    "collector/vectors/store_catalog.py": "a vector store's created_ns",
    "gpu/dispatch/file.py": "the dispatch file header's written_ns",
    "gpu/dispatch/report.py": "the wall time of a status answer",
    "gpu/engines/upstream.py": "a Retry-After given as an HTTP date (wall time) turned into seconds",
    "collector/completion/job_webhooks.py": "a job's end event's created_at (unix seconds)",
    "collector/webhook_outbox.py": "webhook-timestamp and its retry times (unix seconds, on disk)",
    "collector/completion/control.py": "the pause mark's time (a timestamp for people)",
    "gpu/dispatch/dispatch_stage.py": "the wall clock's offset from step's clock, read once at "
    "start: deadlines are wall times written in job records",
    "gpu/dispatch/promise.py": "a new job's deadline (a wall time) against the time it is asked",
    "pipeline/store/reuse_store.py": "a reuse data file's roll time and retention (file mtimes)",
    "ingest/weights_digest.py": "a weight file's mtime against the time it was hashed (a file "
    "changed in the same clock tick is hashed again at the next start)",
}


def product_modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for folder in PRODUCT_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
    )


def wall_clock_calls(path: Path) -> list[int]:
    """Line numbers of wall-clock reads in a module: `from time import time[_ns]` (any call
    of it is one) and calls of time.time() and time.time_ns()."""
    tree = ast.parse(path.read_text())
    imported = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "time"
        and any(alias.name in ("time", "time_ns") for alias in node.names)
    ]
    called = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("time", "time_ns")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    ]
    return sorted(imported + called)


def test_only_the_modules_allowed_read_the_wall_clock():
    calls = {module: wall_clock_calls(ROOT / module) for module in product_modules()}
    readers = {module for module, lines in calls.items() if lines}
    unexpected = {module: calls[module] for module in sorted(readers - set(WALL_CLOCK_ALLOWED))}
    assert not unexpected, f"wall-clock reads (module: lines): {unexpected}; use time.monotonic()"
    stale = sorted(set(WALL_CLOCK_ALLOWED) - readers)
    assert not stale, f"{stale} no longer read the wall clock: take them off WALL_CLOCK_ALLOWED"


def test_the_wall_clock_check_sees_every_way_of_calling_it(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import time\nfrom time import time_ns\nfrom time import time as now\n"
        "a = time.time()\nb = time.time_ns()\nc = time_ns()\nd = now()\ne = time.monotonic()\n"
    )
    assert wall_clock_calls(path) == [2, 3, 4, 5]
