"""Trust nothing (issue 14, points 2, 8 and 11), with real broker processes.

A worker that lies about its results (tests/procs/lying_worker.py) never makes
a job undeliverable: completion refuses each bad result, hands it back or
stores the item's error, and `results` (plain and `--all`) writes every line.
Item errors (a cancel of 20,000 queued items) are retired by completion's
RETIRED, and dispatch's queue of item errors to send again empties.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import test_dispatch_pipeline
import zygote
from broker import REPO, submit
from conftest import wait_for
from test_dispatch_pipeline import (
    assert_each_once,
    cli,
    fetch,
    finished,
    job_info,
    stop_and_check,
    submit_job,
)
from test_metrics import scrape_when, value

from collector.results_client import DispatchClient
from gpu.worker.options import WorkerOptions

broker = test_dispatch_pipeline.broker  # the fixture: a real broker, fast dispatch timeouts

LIES = {1: "wrong_size", 2: "wrong_kind", 3: "bad_status", 4: "not_finite", 5: "wrong_dimension"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # every item in one lane, so the echo embeddings share a dim


def dispatch_status(b) -> dict:
    client = DispatchClient(b.settings.dispatch.bind, timeout_s=5.0)
    try:
        return client.broker_status()
    finally:
        client.close()


def write_embeddings(path: Path, n: int) -> None:
    """n embedding lines for `echo`, custom_ids r0..r{n-1}, each prompt unique."""
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [i + 1, *PROMPT]},
        }
        for i in range(n)
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))


def lying_worker(b, tmp_path: Path, lies: int = -1) -> subprocess.Popen:
    options = WorkerOptions(
        broker=b.settings.dispatch.bind,
        model="echo",
        heartbeat=b.settings.dispatch.heartbeat_bind,
        engine="echo",
        batch_items=16,
        prefetch=1,
        target_batch_s=0,
    )
    args = [sys.executable, str(REPO / "tests" / "procs" / "lying_worker.py"), "worker"]
    args += options.argv()
    env = {**os.environ, "FABRIC_LIES": str(lies)}
    with open(tmp_path / "liar.log", "w") as log:  # the child keeps its own copy
        return zygote.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)


def test_a_lying_worker_cannot_make_a_job_undeliverable(tmp_path, broker):
    """Point 2 and 11: wrong size, wrong kind, a bad status, NaN and a wrong dimension from a
    worker. Each bad result is refused before it is stored (NaN: the item's error at once; the
    rest handed back, an attempt each, and stored as `invalid_result` on the last attempt), so
    the job finishes and `results` and `results --all` write every line, each once."""
    n = 96
    data = tmp_path / "t.jsonl"
    write_embeddings(data, n)
    b = broker(workers=0)
    assert submit(b.config, data, "--job-id", "t").returncode == 0
    liar = lying_worker(b, tmp_path)
    try:
        wait_for(lambda: finished(b, "t"), "the job to finish despite its lying worker", 120)
        out, everything = tmp_path / "out.jsonl", tmp_path / "all.jsonl"
        for path, args in ((out, ()), (everything, ("--all",))):
            result = fetch(b, "t", path, *args)
            assert result.returncode == 0, result.stderr
            assert_each_once(path, n)
            written = [json.loads(x) for x in path.read_text().splitlines()]
            assert sorted(int(x["custom_id"][1:]) for x in written) == list(range(0, n, 6))
            for x in written:
                vector = x["response"]["body"]["data"][0]["embedding"]
                assert vector[:8] == [int(x["custom_id"][1:]) + 1, *PROMPT]
            errors = [json.loads(x) for x in Path(f"{path}.errors.jsonl").read_text().splitlines()]
            assert len(errors) == n - len(written)
            for e in errors:
                i = int(e["custom_id"][1:])
                assert e["error"]["code"] == "invalid_result", e
                assert LIES[i % 6] in e["error"]["message"], e
        info = job_info(b, "t")
        assert (info["completed"], info["failed"]) == (len(written), n - len(written))
        url = f"http://{b.settings.metrics.bind}/metrics"
        samples = scrape_when(
            url,
            "every refusal to be counted",
            lambda s: (
                all(value(s, "fabric_results_refused_total", cause=c) for c in LIES.values())
                and value(s, "fabric_items_reclaimed_total", cause="result_refused")
            ),
        )
        assert value(samples, "fabric_results_refused_total", cause="not_finite") == n // 6
    finally:
        liar.kill()
        liar.wait(timeout=10)
    stop_and_check(b)


def test_results_handed_back_are_computed_again_and_stored_when_the_worker_turns_honest(
    tmp_path, broker
):
    """Point 2: a refused result (but NaN) hands its item back; computed again (here by the
    same worker, honest after its first message) it is stored. Only the NaN items fail."""
    n = 48
    data = tmp_path / "h.jsonl"
    write_embeddings(data, n)
    b = broker(workers=0)
    assert submit(b.config, data, "--job-id", "h").returncode == 0
    liar = lying_worker(b, tmp_path, lies=1)
    try:
        wait_for(lambda: finished(b, "h"), "the job to finish", 120)
        out = tmp_path / "out.jsonl"
        result = fetch(b, "h", out, "--all")
        assert result.returncode == 0, result.stderr
        assert_each_once(out, n)
        errors = [json.loads(x) for x in Path(f"{out}.errors.jsonl").read_text().splitlines()]
        assert errors and all(int(e["custom_id"][1:]) % 6 == 4 for e in errors), errors
        assert all("not_finite" in e["error"]["message"] for e in errors)
        for x in (json.loads(x) for x in out.read_text().splitlines()):
            vector = x["response"]["body"]["data"][0]["embedding"]
            assert vector[:8] == [int(x["custom_id"][1:]) + 1, *PROMPT]
            assert len(vector) == 64  # the lane's width: the echo engine's dimension
        scrape_when(  # what its first message lied about (but NaN) went back, not failed
            f"http://{b.settings.metrics.bind}/metrics",
            "the hand-backs to be counted",
            lambda s: value(s, "fabric_items_reclaimed_total", cause="result_refused") > 0,
        )
    finally:
        liar.kill()
        liar.wait(timeout=10)
    stop_and_check(b)


def test_cancelled_items_are_retired_and_dispatch_stops_sending_them_again(tmp_path, broker):
    """Point 8: completion's RETIRED names slots (seq 0); dispatch matched item errors by seq,
    so after a cancel it sent every item error again every 5 s for ever. Now the queue of item
    errors not yet retired empties, as dispatch's status says."""
    n = 20_000
    b = broker(workers=0)
    submit_job(b, tmp_path, n, "c")
    cancel = cli(b, "cancel", "c")
    assert cancel.returncode == 0, cancel.stderr
    wait_for(lambda: finished(b, "c"), "the cancelled job to finish", timeout_s=120)
    wait_for(
        lambda: dispatch_status(b)["unretired_item_errors"] == 0,
        "dispatch's item errors to be retired",
        timeout_s=30,
    )
    samples = scrape_when(
        f"http://{b.settings.metrics.bind}/metrics",
        "the metric to show no unretired item error",
        # completion's figures come in its own periodic report: wait for them too
        lambda s: (
            value(s, "fabric_unretired_item_errors") == 0
            and value(s, "fabric_items_completed_total") == n
        ),
    )
    assert value(samples, "fabric_items_completed_total") == n
    out = tmp_path / "c.out.jsonl"
    result = fetch(b, "c", out)
    assert result.returncode == 0, result.stderr
    assert_each_once(out, n)
    assert not out.read_text()
    stop_and_check(b)
