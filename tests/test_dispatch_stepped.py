"""The dispatch stage's wiring, stepped in-process with a fake clock (tests/dispatch_stepped.py).

These replace multi-process tests whose cost was waiting for real timers
(the poison item took 38 s): the same stage code runs, over real sockets and
segment files, and the test moves its clock past the session timeout.
"""

from __future__ import annotations

import ast
import time

import numpy as np
import pytest
from broker import REPO
from dispatch_stepped import JOB_NO, MT, SteppedDispatch, input_segment
from prometheus_client import CollectorRegistry, generate_latest

from collector.status_watch import lane_rows
from pipeline.core import item_seq
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.telemetry.metrics import encode_samples
from pipeline.telemetry.metrics_hub import MetricsHub
from pipeline.telemetry.metrics_server import FabricCollector


@pytest.fixture
def stepped(tmp_path):
    made = []

    def make(n: int) -> SteppedDispatch:
        d = SteppedDispatch(tmp_path)
        input_segment(d.data_dir, 1, n)
        made.append(d)
        return d.open()

    yield make
    for d in made:
        d.close()


@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_a_poison_item_is_dead_lettered_alone_and_the_rest_of_its_job_completes(stepped, failure):
    """Each worker that gets the poison item dies with it: SIGKILLed (silent until its session
    times out) or, with a hung engine, its watchdog hands the batch back counting an attempt
    and says BYE. After max_attempts (the last try alone) dispatch dead-letters that one item
    and sends it to completion as an ITEM_ERRORS; every other item is stored once."""
    started = time.monotonic()
    d = stepped(300)
    config = d.settings.dispatch
    poison = item_seq.seq_of(JOB_NO, 37)
    worker, failures = d.worker(), 0
    for _ in range(500):
        if len(d.completion.results) + len(d.completion.errors) == 300:
            break
        work = d.work(worker)
        if work is None:
            continue
        items = work.arrays["items"]
        if poison not in items["seq"]:
            worker.answer(work)
            continue
        failures += 1
        if failure == "killed":
            worker.close()  # it says nothing more
            d.step(config.session_timeout_s + 0.1)
        else:
            worker.send(MT.HAND_BACK, {"reason": "hung", "count_attempt": True}, {"items": items})
            worker.send(MT.BYE)
            d.step()
        worker = d.worker()
    assert failures == config.max_attempts
    assert list(d.completion.errors) == [poison]
    assert d.completion.errors[poison].startswith(ItemErrorCode.DEAD_LETTERED)
    others = set(item_seq.seq_of(JOB_NO, np.arange(300, dtype=np.uint32)).tolist()) - {poison}
    assert set(d.completion.results) == others  # completion keeps one of each (by job, index):
    # a batch answered but not yet retired when its session was lost is computed again
    cause = "session_lost" if failure == "killed" else "handed_back"
    assert d.stage.reclaimed[cause] > 0 and d.stage.counts[ItemErrorCode.DEAD_LETTERED] == 1
    assert d.stage.item_errors.unretired == []  # completion retired the dead letter
    assert time.monotonic() - started < 30  # about a second alone; bounded under load


def metrics_queued(d: SteppedDispatch) -> int:
    """fabric_queued_items as /metrics shows it: the stage's samples through the supervisor's
    hub and the metrics server's collector."""
    hub = MetricsHub()
    hub.started("dispatch-0", 1)
    assert hub.update("dispatch-0", 1, encode_samples(d.stage.stats(d.now)))
    registry = CollectorRegistry()
    registry.register(FabricCollector(hub, d.data_dir))
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("fabric_queued_items{")]
    assert lines, text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)


def test_status_watch_and_metrics_show_one_queue_depth_after_a_reclaim(stepped):
    """Worker a holds slots 0-9, worker b slots 10-19 of 50; a is killed and its session
    times out: its items go back and the cursor rewinds to slot 0 while b still holds 10-19.
    Items waiting: 40, in the status answer, in the watch's lanes and on /metrics."""
    d = stepped(50)
    a, b = d.worker(max_items=10), d.worker(max_items=10)
    work_a, work_b = d.work(a), d.work(b)
    assert work_a.arrays["items"]["slot"].tolist() == list(range(10))
    assert work_b.arrays["items"]["slot"].tolist() == list(range(10, 20))
    a.close()  # killed: silent from now on
    b.report(work_b.arrays["items"], work_b.meta["batch_id"])  # b lives and keeps its lease
    d.step(d.settings.dispatch.session_timeout_s + 0.1)
    assert d.stage.reclaimed["session_lost"] == 10
    info = d.broker_info()
    status = sum(q["queued"] for q in info["queues"])
    watch = sum(row[2] for row in lane_rows(info, time.time_ns()))
    assert (status, watch, metrics_queued(d)) == (40, 40, 40)
    assert info["in_flight"] == 10


def test_a_worker_saying_hello_twice_holding_work_is_counted_once(stepped):
    """A worker whose WELCOME is late (a dispatch just restarted, busy) says hello again; both
    reach dispatch. The status answer's registered_holding counts sessions, not hellos: a test
    waiting for a fleet of 3 to come back saw 4 and timed out."""
    d = stepped(50)
    a, b = d.worker(max_items=10), d.worker(max_items=10)
    work_a, work_b = d.work(a), d.work(b)
    a.hello(holding=work_a)
    a.hello(holding=work_a)
    b.hello(holding=work_b)
    for worker in (a, a, b):
        known = d.until(worker, MT.WELCOME).arrays["known"]
        assert known.tolist() == [1] * 10  # still its own, to keep running
    assert d.broker_info()["registered_holding"] == 2


def test_the_stage_takes_its_time_from_step_only():
    """No module of gpu/dispatch/ reads the monotonic clock except the stage's open() (its
    start) and drain() (the run loop's deadline): everything else uses `now` from step(now),
    which is what lets these tests drive it with a fake clock."""
    allowed = {
        ("dispatch_stage.py", "open"),
        ("dispatch_stage.py", "drain"),
        ("file.py", "_write_queued"),
    }
    # file.py: the dispatch file's own writer thread, which paces its error log
    found = []
    for path in sorted((REPO / "gpu" / "dispatch").glob("*.py")):
        tree = ast.parse(path.read_text())
        owner = {}  # node -> the innermost function around it
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(function):
                    owner[node] = function.name  # inner functions are walked later: they win
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("monotonic", "monotonic_ns", "perf_counter")
                and isinstance(node.value, ast.Name)
                and node.value.id == "time"
                and (path.name, owner.get(node, "<module>")) not in allowed
            ):
                found.append(f"{path.name}:{node.lineno} in {owner.get(node, '<module>')}")
    assert found == []
