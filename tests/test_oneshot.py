"""`run.py batch`: the one-shot run, with real processes killed with SIGKILL and run again.

Each run starts a broker of its own (the real supervisor, stages and a local worker) as a
child in the batch command's process group; the test kills that whole group at a few
points, runs the same command again, and checks that the output holds each custom_id once,
that the run ends with exit 0, and that the data dir passes the consistency check.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zygote
from broker import REPO, WORDS, write_config
from conftest import assert_check_clean, wait_for

from config import load_settings
from pipeline import exitcodes
from pipeline.datadir import DataDir
from pipeline.ring import Ring
from pipeline.topology import ring_specs

LINES = 1200  # about 5 s of the simulated worker: enough to kill it while results stream
RUN_BOUND_S = 240  # one whole run to the end, broker start and stop included, under load


def write_input(path: Path, n: int, model: str = "sim") -> None:
    """n embedding lines of text for `model`, and two broken ones (they get error lines)."""
    with open(path, "w") as out:
        for i in range(n):
            body = {"model": model, "input": " ".join(WORDS[i % 300 : i % 300 + 5 + i % 15])}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(json.dumps(line) + "\n")
            if i in (10, n // 2):
                out.write('{"custom_id": "broken", "method": "POST"\n')


def batch(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return zygote.Popen(
            [sys.executable, str(REPO / "run.py"), "batch", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
            start_new_session=True,  # its own process group: the batch command and its broker
        )


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: not _group_alive(proc.pid), "the killed group to be gone", timeout_s=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def outcomes(out: Path) -> Counter:
    """custom_id (or the error line's id when the line had none) -> lines in OUT and its errors."""
    counts: Counter = Counter()
    for path in (out, Path(f"{out}.errors.jsonl")):
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                counts[record["custom_id"] or record["id"]] += 1
    return counts


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_batch_killed_twice_and_run_again_resumes_with_each_custom_id_once(tmp_path):
    config = write_config(tmp_path, workers=0)
    text = config.read_text().replace(
        "[workers]\nlocal = 0\n",
        '[workers]\nlocal = 1\nmodel = "sim"\nsimulated_tokens_per_s = 3000.0\nbatch_items = 64\n',
    )
    config.write_text(text)
    settings = load_settings(config)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, LINES)
    args = (str(source), "-o", str(out), "--config", str(config))
    log = tmp_path / "batch.err"
    procs: list[subprocess.Popen] = []
    try:
        # 1. Killed while submitting or just after: the job exists, few results yet.
        first = batch(*args, log=log)
        procs.append(first)
        wait_for(
            lambda: any((settings.data_path / "jobs").glob("batch-*")),
            "the job to be created",
            timeout_s=120,
        )
        kill_group(first)
        # 2. Killed while results stream into OUT.
        second = batch(*args, log=log)
        procs.append(second)
        wait_for(lambda: lines_in(out) >= LINES // 3, "a third of the results", timeout_s=180)
        kill_group(second)
        done_before = lines_in(out)
        assert done_before < LINES, "the run finished before the kill: make it slower"
        # 3. Run to the end.
        began = time.monotonic()
        last = batch(*args, log=log)
        procs.append(last)
        assert last.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
        elapsed = time.monotonic() - began
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for ring in ring_specs(settings):
            Ring.unlink(ring.name)
    counts = outcomes(out)
    twice = [k for k, c in counts.items() if c > 1]
    assert not twice, f"{len(twice)} custom_ids written twice, e.g. {twice[:5]}"
    assert len(counts) == LINES + 2, f"{len(counts)} of {LINES + 2} lines have their outcome"
    assert sum(1 for k in counts if "-line-" in k) == 2  # the broken lines' error lines
    assert elapsed < RUN_BOUND_S
    assert_check_clean(DataDir(settings.data_path))
    check = subprocess.run(
        [sys.executable, "run.py", "check", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert check.returncode == exitcodes.OK, check.stdout + check.stderr


def test_batch_with_a_model_alone_runs_a_private_broker_beside_the_output(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "sub" / "out.jsonl"
    out.parent.mkdir()
    with open(source, "w") as f:
        for i in range(200):
            body = {"model": "echo", "prompt_token_ids": list(range(1, 3 + i % 40))}
            line = {"custom_id": f"e{i}", "method": "POST", "url": "/v1/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")
    args = (str(source), "-o", str(out), "--model", "echo")
    log = tmp_path / "batch.err"
    for _ in range(2):  # the second run finds everything done and writes nothing twice
        proc = batch(*args, log=log)
        try:
            assert proc.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        counts = outcomes(out)
        assert len(counts) == 200 and max(counts.values()) == 1
    data = out.parent / "out.jsonl.fabric" / "data"
    assert (data / "jobs").is_dir()
    assert_check_clean(DataDir(data))
    # Another input to the same output is refused, not mixed in.
    other = tmp_path / "other.jsonl"
    other.write_text(source.read_text().replace('"e1"', '"x1"'))
    refused = subprocess.run(
        [sys.executable, "run.py", "batch", str(other), "-o", str(out), "--model", "echo"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert refused.returncode == exitcodes.FAILED
    assert "was not written for this input" in refused.stderr
    assert len(outcomes(out)) == 200
