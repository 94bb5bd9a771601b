"""Issue 20 with real processes: a worker stopped past its session timeout while its engine
runs a batch, then resumed once its items were retired elsewhere, must not hold work it can
never run. Before the fix, re-registration trimmed its waiting batch to nothing while the
engine ran, the engine thread died on the next batch ("returned 4 outcomes for 0 items"), the
session went on reporting and asking, and the batch it got next was never run: that job never
finished. After it, the job finishes within a bounded time and `check` is clean.

Dispatch does not rely on the worker alone: a session that reports (renewing its leases) but
never answers its batches is found stalled and its batches are reclaimed."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

from broker import submit
from conftest import wait_for
from test_dispatch_pipeline import (  # noqa: F401 (fixtures)
    FAST,
    assert_each_once,
    broker,
    cli,
    fetch,
    finished,
    job_info,
    stop_and_check,
    workers,
)

from collector.results_client import DispatchClient
from gpu.engines.base import TransientEngineError
from gpu.worker.options import WorkerOptions
from gpu.worker.session import Worker

# The simulated engine: a 4-item batch of 100 tokens each runs 20 s, which outlasts the stop
# (session timeout 2 s, a cancel and a submit: about 6 s quiet); 40 s proved nothing more.
TOKENS_PER_S = 20
AFTER_RESUME_S = 60.0  # the bound: what is left of that batch, then the next job


def write_lines(path: Path, n: int, tokens: int) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [5] * tokens},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def broker_info(b) -> dict:
    with DispatchClient(b.settings.dispatch.bind, timeout_s=5.0) as client:
        return client.broker_status()


def test_a_worker_resumed_after_its_items_were_retired_still_runs_new_work(
    tmp_path,
    broker,  # noqa: F811 (the fixture)
    workers,  # noqa: F811
):
    b = broker(workers=0)
    slow = tmp_path / "a.jsonl"
    write_lines(slow, 8, tokens=100)  # two batches of 4: one runs (20 s), one waits
    assert submit(b.config, slow, "--job-id", "a").returncode == 0
    worker = workers(b, "simulated", f"tokens_per_s={TOKENS_PER_S}", batch_items=4, prefetch=2)
    wait_for(
        lambda: [w["batches"] for w in broker_info(b)["workers"]] == [2],
        "the worker to hold both batches, one running",
    )
    worker.send_signal(signal.SIGSTOP)  # past its session timeout, while the batch runs
    try:
        wait_for(lambda: broker_info(b)["workers"] == [], "dispatch to declare the session gone")
        # Its items are retired meanwhile (cancelled here; another worker would do as well).
        assert cli(b, "cancel", "a", timeout_s=60).returncode == 0
        wait_for(lambda: finished(b, "a"), "job a to end cancelled")
        quick = tmp_path / "b.jsonl"
        write_lines(quick, 4, tokens=1)
        assert submit(b.config, quick, "--job-id", "b").returncode == 0
    finally:
        worker.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    wait_for(
        lambda: finished(b, "b"),
        f"job b to finish within {AFTER_RESUME_S:.0f} s of the worker's resume (the stopped "
        "worker re-registered holding only retired items; if it holds work it never runs, "
        "job b never finishes)",
        timeout_s=AFTER_RESUME_S,
    )
    assert time.monotonic() - resumed < AFTER_RESUME_S
    assert worker.poll() is None, "the worker lives on: nothing was wrong with its engine"
    for job, n in (("a", 8), ("b", 4)):
        out = tmp_path / f"{job}.out.jsonl"
        assert fetch(b, job, out).returncode == 0
        assert_each_once(out, n)
    assert job_info(b, "b")["completed"] == 4
    stop_and_check(b)


class _NeverEngine:
    """An engine that takes a batch and never finishes it, nor fails: only dispatch can tell."""

    name = "never"

    def __init__(self) -> None:
        self.release = threading.Event()

    def load(self) -> None:
        pass

    def figures(self) -> dict:
        return {}

    def broken(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    def run(self, batch):
        self.release.wait()
        raise TransientEngineError("released at the end of the test")


def test_dispatch_reclaims_the_batches_of_a_session_that_reports_but_never_answers(
    tmp_path,
    broker,  # noqa: F811 (the fixture)
    workers,  # noqa: F811
):
    b = broker(workers=0, dispatch=FAST + "\nstall_min_s = 3.0")
    data = tmp_path / "s.jsonl"
    write_lines(data, 40, tokens=3)
    assert submit(b.config, data, "--job-id", "s").returncode == 0
    engine = _NeverEngine()
    options = WorkerOptions(
        b.settings.dispatch.bind, "echo", batch_items=4, prefetch=2, batch_timeout_s=0, drain_s=1
    )
    zombie = Worker(options, engine)  # its reports renew its leases; its engine never answers
    zombie.open()
    stop = threading.Event()
    loop = threading.Thread(target=zombie.run, args=(stop.is_set,), daemon=True)
    loop.start()
    try:
        # Handed, not held: on a loaded host the stall watch may reclaim them before a poll
        # sees the session hold both (stall_min_s after the first).
        wait_for(
            lambda: [w["handed_out"] for w in broker_info(b)["workers"]] == [8],
            "the session to be handed two batches (8 items) it will never answer",
        )
        workers(b)  # an honest worker does everything else
        wait_for(
            lambda: finished(b, "s"),
            "the job to finish: dispatch reclaims the stalled session's batches after "
            "stall_min_s (without the stall watch its leases are renewed for ever)",
            timeout_s=60,
        )
        mine = [w for w in broker_info(b)["workers"] if w["session"] == zombie.session]
        assert [(w["stalled"], w["batches"]) for w in mine] == [(True, 0)]
    finally:
        stop.set()
        engine.release.set()
        loop.join(10)
        zombie.close()
    out = tmp_path / "s.out.jsonl"
    assert fetch(b, "s", out).returncode == 0
    assert_each_once(out, 40)
    stop_and_check(b)
