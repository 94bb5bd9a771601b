"""Pause and resume with real processes: `run.py pause` / `resume` against a broker, its
workers and a kill -9 (issue 35 item 3). The fixtures and helpers are the back half's
(tests/test_dispatch_pipeline.py)."""

from __future__ import annotations

import test_dispatch_pipeline as back_half
from broker import Broker, submit, write_jsonl
from conftest import wait_for
from test_dispatch_pipeline import (
    cli,
    finishes_once_computed_once,
    job_info,
    stop_and_check,
    submit_job,
)

from pipeline.core import exitcodes

broker, workers = back_half.broker, back_half.workers  # its fixtures, for these tests too


def queued(b: Broker) -> int:
    return sum(q["queued"] for q in b.broker_status()["queues"])


def paused_metrics(b: Broker) -> tuple[float, float]:
    return b.metric("fabric_paused_jobs"), b.metric("fabric_paused_items")


def held_while_another_runs(b: Broker, tmp_path, job: str, other: str) -> None:
    """`job` is paused: `other` runs to the end while every item of `job` stays queued."""
    info = job_info(b, job)
    assert info["paused"] is True and info["state"] == "queued", info
    submit_job(b, tmp_path, 200, other)
    finishes_once_computed_once(b, tmp_path, other, 200, timeout_s=60)
    info = job_info(b, job)
    assert (info["completed"], info["failed"], info["pending"]) == (0, 0, 300), info
    assert info["paused"] is True
    wait_for(lambda: queued(b) == 300, "the paused job's items to be counted queued")
    wait_for(lambda: paused_metrics(b) == (1, 300), "the metrics to count the paused items")


def test_a_paused_job_waits_while_another_runs_and_completes_once_resumed(
    tmp_path, broker, workers
):
    b = broker(workers=0)
    submit_job(b, tmp_path, 300, "p")
    result = cli(b, "pause", "p")
    assert result.returncode == 0, result.stderr
    assert "paused" in result.stderr
    status = cli(b, "status", "p")
    assert status.stdout.startswith("job p: queued (paused"), status.stdout
    workers(b)  # a `run.py worker` process: it would take p's items if they were offered
    held_while_another_runs(b, tmp_path, "p", "q")
    assert cli(b, "pause", "q").returncode == exitcodes.FAILED  # q has completed
    assert cli(b, "resume", "p").returncode == 0
    assert job_info(b, "p")["paused"] is False
    finishes_once_computed_once(b, tmp_path, "p", 300, timeout_s=60)
    stop_and_check(b)


def test_a_pause_outlives_kill_9_of_the_broker(tmp_path, broker):
    """Submitted with --priority 4, paused and its priority changed to 3, then the broker killed with SIGKILL and started
    again with a local worker: dispatch reads the pause mark before it hands anything out,
    so the job still waits; its priority is still the one set."""
    b = broker(workers=0)
    write_jsonl(tmp_path / "p.jsonl", 300)
    assert (
        submit(b.config, tmp_path / "p.jsonl", "--job-id", "p", "--priority", "4").returncode == 0
    )
    assert job_info(b, "p")["priority"] == 4  # from the job's record
    assert cli(b, "pause", "p").returncode == 0
    assert cli(b, "priority", "p", "3").returncode == 0
    b.kill()
    b.config.write_text(b.config.read_text().replace("local = 0", "local = 1"))
    b.__init__(b.config)
    b.start()
    assert job_info(b, "p")["priority"] == 3
    held_while_another_runs(b, tmp_path, "p", "q")
    assert cli(b, "resume", "p").returncode == 0
    finishes_once_computed_once(b, tmp_path, "p", 300, timeout_s=60)
    stop_and_check(b)
