"""Deadlines end to end with real processes: `run.py submit --deadline`, one slow worker."""

from __future__ import annotations

import os
import subprocess
import sys

import zygote
from broker import REPO, Broker, submit, write_config, write_jsonl
from conftest import assert_check_clean, wait_for

from collector.results_client import ResultsClient
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes

FAST = """lease_s = 6.0
session_timeout_s = 2.0
reregister_grace_s = 1.0
report_s = 0.3"""
LINES = 200


def test_two_jobs_complete_in_deadline_order_not_in_submit_order(tmp_path):
    """Job `later` (deadline in 2 h) is submitted first, job `sooner` (in 10 minutes) second,
    both queued before the one worker (simulated, 20,000 tokens/s, 16 items a batch) starts,
    and dispatch is SIGKILLed in between (restarted, it has only the job records to go by):
    `sooner` completes while `later` is still in progress, and `later` completes too."""
    b = Broker(write_config(tmp_path, workers=0, dispatch=FAST))
    worker = None
    try:
        b.start()
        for job, deadline in (("later", "2h"), ("sooner", "10m")):
            write_jsonl(tmp_path / f"{job}.jsonl", LINES, seed=len(job))
            done = submit(
                b.config, tmp_path / f"{job}.jsonl", "--job-id", job, "--deadline", deadline
            )
            assert done.returncode == 0, done.stderr
        b.kill_stage("dispatch-0")  # the restarted dispatch learns the deadlines from the records
        options = WorkerOptions(
            broker=b.settings.dispatch.bind,
            model="echo",
            heartbeat=b.settings.dispatch.heartbeat_bind,
            engine="simulated",
            batch_items=16,
            prefetch=1,
            target_batch_s=0,
        )
        argv = [*options.argv(), "--option", "tokens_per_s=20000"]
        worker = zygote.Popen(
            [sys.executable, str(REPO / "run.py"), "worker", *argv],
            cwd=REPO,
            env=dict(os.environ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with ResultsClient(b.settings.completion.bind, timeout_s=10) as client:
            status = client.job_status
            wait_for(lambda: status("sooner")["state"] == "completed", "`sooner` to complete", 120)
            later = status("later")
            assert later["state"] != "completed" and later["completed"] < LINES, later
            wait_for(lambda: status("later")["state"] == "completed", "`later` to complete", 120)
        worker.terminate()
        worker.wait(timeout=60)
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        b.close()
