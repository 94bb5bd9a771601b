"""`run.py batch`: the one-shot run, with real processes killed with SIGKILL and run again.

Each run starts a broker of its own (the real supervisor, stages and a local worker) as a
child in the batch command's process group; the test kills that whole group at a few
points, runs the same command again, and checks that the output holds each custom_id once,
that the run ends with exit 0, and that the data dir passes the consistency check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zygote
from broker import REPO, WORDS, Broker, write_config
from client_commands import run_cli
from conftest import assert_check_clean, read_only_dir, wait_for

from config import load_settings
from pipeline.core import exitcodes
from pipeline.process.supervisor_report import read_report
from pipeline.store.datadir import DataDir
from pipeline.transport.ring import Ring
from pipeline.transport.topology import ring_specs

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


def running_in_group(pgid: int) -> list[int]:
    """Pids of the processes of group `pgid` that still run (zombies, which only wait for
    their parent to reap them, left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue  # not a process, or gone
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def sim_config(tmp_path: Path, tokens_per_s: float, more: str = "") -> Path:
    """A broker config with one local worker of the simulated engine at `tokens_per_s`."""
    config = write_config(tmp_path, workers=0)
    text = config.read_text().replace(
        "[workers]\nlocal = 0\n",
        f'[workers]\nlocal = 1\nmodel = "sim"\nsimulated_tokens_per_s = {tokens_per_s}\n'
        f"batch_items = 64\n{more}",
    )
    config.write_text(text)
    return config


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
    config = sim_config(tmp_path, 3000.0)
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
        # 3. Run to the end. It says it resumes, and how far the killed runs got.
        written = done_before + lines_in(Path(f"{out}.errors.jsonl"))
        said_before = len(log.read_text())
        began = time.monotonic()
        last = batch(*args, log=log)
        procs.append(last)
        assert last.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
        elapsed = time.monotonic() - began
        said = log.read_text()[said_before:]
        assert f"resuming: {written:,} of {LINES + 2:,} lines already in {out} " in said, said
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
        said_before = len(log.read_text()) if log.exists() else 0
        proc = batch(*args, log=log)
        try:
            assert proc.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        counts = outcomes(out)
        assert len(counts) == 200 and max(counts.values()) == 1
    said = log.read_text()[said_before:]  # the second run's: it queued nothing, and says so
    assert f"resuming: 200 of 200 lines already in {out} (200 results)" in said, said
    assert "an earlier run had queued every line (200 queued, 0 rejected)" in said, said
    assert "lines queued" not in said, said
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


def test_a_batch_that_fails_before_it_starts_leaves_no_state_dir(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, 3, model="echo")
    for more, says in (
        ((), "name the model: --model NAME"),  # no model
        (("--model", "nosuch"), "--model nosuch is not an engine name"),
        (("--model", "m", "--engine", "nosuch"), "nosuch"),  # the generated config is refused
    ):
        done = run_cli("batch", str(source), "-o", str(out), *more)
        assert done.returncode in (exitcodes.FAILED, exitcodes.CONFIG), done.stderr
        assert says in done.stderr, done.stderr
        assert not Path(f"{out}.fabric").exists(), (more, sorted(tmp_path.iterdir()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_an_output_in_a_read_only_directory_is_named_with_its_exit_code(tmp_path):
    source = tmp_path / "in.jsonl"
    write_input(source, 3, model="echo")
    with read_only_dir(tmp_path / "ro") as ro:
        command = ["batch", str(source), "-o", str(ro / "out.jsonl"), "--model", "echo"]
        done = subprocess.run(
            [sys.executable, "run.py", *command],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    assert done.returncode == exitcodes.CANNOT_WRITE, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"error: cannot write {ro / 'out.jsonl.fabric'}: " in done.stderr, done.stderr
    assert "choose another -o" in done.stderr


def test_a_file_in_which_no_line_succeeded_says_so_with_its_own_exit_code(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(source, "w") as f:
        for i in range(5):  # a model the broker does not serve: every line gets an error line
            body = {"model": "nosuch", "prompt_token_ids": [1, 2, 3]}
            line = {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings"}
            f.write(json.dumps({**line, "body": body}) + "\n")
    log = tmp_path / "batch.err"
    proc = batch(str(source), "-o", str(out), "--model", "echo", log=log)
    try:
        assert proc.wait(timeout=RUN_BOUND_S) == exitcodes.ALL_FAILED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = log.read_text()
    assert f"no line succeeded: all 5 lines failed; see {out}.errors.jsonl (the first says: " in (
        said
    ), said
    assert "nosuch" in said.splitlines()[-1]  # why, from the first error line
    assert lines_in(Path(f"{out}.errors.jsonl")) == 5 and lines_in(out) == 0


def test_ctrl_c_stops_the_broker_in_order_so_its_worker_drains_at_once(tmp_path):
    # Ctrl-C reaches every process of the group; the stages leave it to the supervisor, which
    # stops them in order: the worker's last results are taken, and it exits in time (stages
    # that stopped on their own left it waiting out `drain_s` for answers, killed at 20 s)
    config = sim_config(tmp_path, 3000.0)
    settings = load_settings(config)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, LINES)
    log = tmp_path / "batch.err"
    proc = batch(str(source), "-o", str(out), "--config", str(config), log=log)
    try:
        wait_for(lambda: lines_in(out) >= 100, "some results", timeout_s=120)
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == exitcodes.INTERRUPTED, log.read_text()[-3000:]
        stopped_s = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    report = read_report(settings.data_path)
    assert {s["stage"]: s["last_exit"] for s in report["stages"]}["worker-0"] == "exit code 0"
    assert {s["last_exit"] for s in report["stages"]} == {"exit code 0"}, report["stages"]
    assert stopped_s < 10, f"the broker took {stopped_s:.1f} s to stop"
    assert "Traceback" not in log.read_text()
    assert_check_clean(DataDir(settings.data_path))


def test_ctrl_c_drains_with_a_word_and_a_second_ctrl_c_stops_at_once(tmp_path):
    # A batch of 64 lines takes about 6 s: the worker is inside one when Ctrl-C comes, and
    # its drain (it finishes that batch) outlasts the test's second Ctrl-C by seconds.
    config = sim_config(tmp_path, 128.0, "target_batch_s = 0\n")
    settings = load_settings(config)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, 400)
    log = tmp_path / "batch.err"
    proc = batch(str(source), "-o", str(out), "--config", str(config), log=log)
    try:
        # its progress line has the rate and the time left (completion's, as `status JOB`)
        progress = r"\d+/402 \(\d+%\) lines done, \d+/s, \d+[smh] left; 2 failed; in_progress"
        wait_for(lambda: re.search(progress, log.read_text()), "a rate and ETA", timeout_s=120)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C on a terminal: the whole group
        wait_for(lambda: "draining (up to" in log.read_text(), "the draining line", timeout_s=30)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == exitcodes.INTERRUPTED, log.read_text()[-3000:]
        wait_for(lambda: not running_in_group(proc.pid), "nothing left running", timeout_s=10)
    finally:
        if proc.poll() is None or running_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    said = log.read_text()
    assert "interrupted: the broker is draining (up to 120 s; Ctrl-C again to stop now)" in said
    assert "stopped now: the broker was killed" in said, said
    assert "Traceback" not in said, said
    assert not [ring.name for ring in ring_specs(settings) if Ring.unlink(ring.name)]
    assert lines_in(out) < 400  # it stopped mid-run; the next run resumes


def broken_engine_config(tmp_path: Path, engine: str, options: str) -> Path:
    """A config whose one local worker serves model `smol` on `engine` with `options`."""
    from gpu.engines.transformers import smollm2_tokenizer_path

    config = write_config(tmp_path, workers=0)
    text = config.read_text().replace("[workers]\nlocal = 0\n", "")
    config.write_text(
        f'{text}\n[[models]]\nname = "smol"\nengine = "{engine}"\n'
        f'tokenizer = "{smollm2_tokenizer_path()}"\nmax_tokens = 64\n'
        f'[[workers]]\nmodel = "smol"\noptions = {{{options}}}\n'
    )
    return config


def completions_input(path: Path, n: int = 16) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "smol", "prompt": f"line {i}", "max_tokens": 4}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")
    return path


def assert_batch_stops_on_the_engine(config: Path, tmp_path: Path, words: str, bound_s) -> None:
    """`run.py batch --config CONFIG` exits FAILED with the engine's own message (containing
    `words`) as its last line, instead of waiting while the worker restarts."""
    source, out = completions_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    log = tmp_path / "batch.err"
    proc = batch(str(source), "-o", str(out), "--config", str(config), log=log)
    try:
        assert proc.wait(timeout=bound_s) == exitcodes.FAILED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = log.read_text().strip().splitlines()[-1]
    assert "worker-0 cannot start its engine" in last and words in last, last


def test_an_engine_that_cannot_start_stops_the_batch_and_status_names_it(tmp_path):
    missing = tmp_path / "no-such-model"  # a model directory that is not there
    config = broken_engine_config(tmp_path, "transformers", f'model = "{missing}"')
    assert_batch_stops_on_the_engine(config, tmp_path, str(missing), RUN_BOUND_S)
    assert_status_names_the_engine(config, str(missing), timeout_s=120)


def assert_status_names_the_engine(config: Path, words: str, timeout_s: float) -> None:
    """A broker of its own on `config` (never all up: its worker's engine cannot start):
    `status` names the worker's exit and the engine's message (containing `words`)."""
    b = Broker(config).launch()
    try:
        said = wait_for(
            lambda: (lambda s: s if words in s else None)(
                run_cli("status", "--config", str(config)).stdout
            ),
            "status to name the engine's error",
            timeout_s=timeout_s,
        )
        # restarting, or (on a loaded host, between two looks) running again a moment before
        # it dies the same way: either way status names the exit and its cause
        assert "local worker-0: " in said and "exit code 10" in said, said
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        b.close()
    assert_check_clean(b.data_dir)
