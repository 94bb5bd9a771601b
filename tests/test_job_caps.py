"""Error and budget caps end to end with real processes: `run.py submit --max-error-rate`,
`--max-errors`, `--max-tokens-budget`; one worker (the echo engine, small batches) started
after the job is queued, so that the job is stopped long before its last line runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import orjson
import pytest
import zygote
from broker import REPO, Broker, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for
from test_metrics import scrape_when, value

from collector.results_client import ResultsClient
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.store.job_files import JobFiles

REFUSE = 777  # the echo engine's refuse_token: an item starting with it gets its own error
LINES = 2000


def write_lines(path, n: int, refused_every: int, length: int = 10) -> None:
    """n embedding lines for `echo` of `length` tokens; every `refused_every`-th starts with
    REFUSE (0: none), so the engine refuses it."""
    with open(path, "wb") as out:
        for i in range(n):
            first = REFUSE if refused_every and i % refused_every == 0 else 1
            body = {"model": "echo", "prompt_token_ids": [first] + [2] * (length - 1)}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(orjson.dumps(line) + b"\n")


def start_worker(b: Broker, simulated: bool) -> subprocess.Popen:
    """One worker for `echo` lines: the echo engine refusing REFUSE, or (`simulated`) the
    simulated engine at 20,000 tokens/s."""
    options = WorkerOptions(
        broker=b.settings.dispatch.bind,
        model="echo",
        heartbeat=b.settings.dispatch.heartbeat_bind,
        engine="simulated" if simulated else "echo",
        batch_items=8,
        prefetch=1,
        target_batch_s=0,
    )
    option = "tokens_per_s=20000" if simulated else f"refuse_token={REFUSE}"
    argv = [*options.argv(), "--option", option]
    return zygote.Popen(
        [sys.executable, str(REPO / "run.py"), "worker", *argv],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_job(
    tmp_path,
    refused_every: int,
    *limits: str,
    end: str,
    simulated: bool = False,
    restart: bool = False,
) -> tuple[dict, Counter, dict]:
    """Submit LINES lines with `limits`, run them on one worker (`start_worker`) until the
    job is `end`; its final JOB_INFO, its error lines' codes, and `status JOB --json`.
    `restart`: once its worker-seconds are on disk, completion is SIGKILLed and the JOB_INFO
    is the restarted completion's, which must say the same."""
    b = Broker(write_config(tmp_path, workers=0))
    worker = None
    try:
        b.start()
        write_lines(tmp_path / "in.jsonl", LINES, refused_every)
        done = submit(b.config, tmp_path / "in.jsonl", "--job-id", "j", *limits)
        assert done.returncode == 0, done.stderr
        worker = start_worker(b, simulated)
        with ResultsClient(b.settings.completion.bind, timeout_s=10) as client:
            wait_for(lambda: client.job_status("j")["state"] == end, f"job to be {end}", 120)
            info = client.job_status("j")
            if restart:
                files = JobFiles(b.settings.data_path)
                on_disk = lambda: round(files.read_worker_seconds("j"), 3) == info["worker_s"]  # noqa: E731
                wait_for(on_disk, "the worker-seconds to be written")
                b.kill_stage("completion-0")
                again = wait_for(lambda: client.job_status("j"), "the restarted completion")
                assert again == {**info, "rate": again["rate"], "eta_s": again["eta_s"]}
            out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
            client.fetch("j", str(out), str(err))
        stopped = 1 if end == "failed" else 0  # the metrics count it (and the engine time)
        scrape_when(
            f"http://{b.settings.metrics.bind}/metrics",
            "the metrics to count the job",
            lambda s: (
                value(s, "fabric_jobs_stopped_by_limit_total") == stopped
                and value(s, "fabric_worker_seconds_total") > 0
            ),
        )
        shown = run_cli("status", "j", "--json", "--config", str(b.config))
        assert shown.returncode == 0, shown.stderr
        codes = Counter(
            orjson.loads(line)["error"]["code"] for line in err.read_bytes().splitlines()
        )
        results = len(out.read_bytes().splitlines())
        assert results + sum(codes.values()) == LINES  # every line once
        assert results == info["completed"]  # results made before the stop are delivered
        worker.terminate()
        worker.wait(timeout=60)
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
        return info, codes, orjson.loads(shown.stdout)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        b.close()


def test_a_job_whose_every_line_fails_stops_after_the_minimum_sample(tmp_path):
    """Every line is refused by the engine: with --max-error-rate 0.5 and --min-sample 40
    the job stops once 40 lines are done; the lines not run get `error_cap`, and it ends
    `failed`, its `stopped` naming the limit and the numbers."""
    info, codes, shown = run_job(
        tmp_path, 1, "--max-error-rate", "0.5", "--min-sample", "40", end="failed", restart=True
    )
    assert info["stopped"]["code"] == "error_cap"
    assert info["stopped"]["limit"] == "max_error_rate"
    assert "min sample 40" in info["stopped"]["message"]
    assert info["limits"] == {"max_error_rate": 0.5, "min_sample": 40}
    assert codes["error_cap"] > LINES // 2, codes  # most lines never ran
    assert codes["item_failed"] >= 40, codes  # the engine's own errors: the sample
    assert shown["state"] == "failed" and shown["stopped"] == info["stopped"]


def test_a_job_under_its_caps_runs_to_the_end(tmp_path):
    """One line in ten fails: under --max-error-rate 0.5 and --max-errors 1000 the job
    completes, each line has its result or its own error, and nothing is stopped."""
    info, codes, _ = run_job(
        tmp_path, 10, "--max-error-rate", "0.5", "--max-errors", "1000", end="completed"
    )
    assert info["stopped"] is None
    assert codes == Counter({"item_failed": LINES // 10}), codes


def test_max_errors_stops_a_job_after_that_many_errors(tmp_path):
    info, codes, _ = run_job(tmp_path, 2, "--max-errors", "30", end="failed")
    assert info["stopped"]["limit"] == "max_errors"
    assert info["failed"] > 30 and codes["error_cap"] > LINES // 2, (info, codes)


def test_a_token_budget_stops_a_job_near_the_budget(tmp_path):
    """Lines of 10 tokens, a budget of 2,000 tokens (a tenth of the job's): the job stops
    with `budget_exceeded` once its results reach the budget; the lines in flight then (and
    those whose results were on their way) finish, so it ends a little past the budget, far
    from the job's 20,000; `stopped` says at how many tokens it stopped, status the total."""
    info, codes, shown = run_job(tmp_path, 0, "--max-tokens-budget", "2000", end="failed")
    assert info["stopped"]["code"] == "budget_exceeded"
    used = info["usage"]["total_tokens"]
    assert 2000 <= used <= 5000, used
    assert "reached max_tokens 2000" in info["stopped"]["message"]
    assert codes["budget_exceeded"] == LINES - info["completed"], codes
    assert shown["usage"]["total_tokens"] == used


def test_worker_seconds_are_the_engine_time_of_the_job(tmp_path):
    """2,000 lines of 10 tokens on the simulated engine at 20,000 tokens/s: 1 s of engine
    time, which `status JOB --json` shows as `worker_s` (the workers' own measure), the same
    after completion is SIGKILLed and restarted."""
    info, codes, shown = run_job(tmp_path, 0, end="completed", simulated=True, restart=True)
    assert not codes
    assert 0.95 <= shown["worker_s"] <= 5.0, shown["worker_s"]
    assert shown["worker_s"] == info["worker_s"]


def test_a_worker_seconds_budget_stops_a_job(tmp_path):
    info, codes, _ = run_job(
        tmp_path, 0, "--max-worker-seconds", "0.3", end="failed", simulated=True
    )
    assert (info["stopped"]["code"], info["stopped"]["limit"]) == (
        "budget_exceeded",
        "max_worker_s",
    )
    assert 0.3 <= info["worker_s"] < 0.9, info["worker_s"]
    assert codes["budget_exceeded"] == LINES - info["completed"] > LINES // 4, codes


@pytest.mark.parametrize(
    ("flag", "value"), [("--max-error-rate", "1.5"), ("--min-sample", "0"), ("--max-errors", "x")]
)
def test_a_bad_limit_is_refused_by_name(tmp_path, flag, value):
    (tmp_path / "in.jsonl").write_bytes(b"")
    done = submit(tmp_path / "none.toml", tmp_path / "in.jsonl", flag, value)
    assert done.returncode == exitcodes.USAGE
    assert flag in done.stderr and value in done.stderr, done.stderr
