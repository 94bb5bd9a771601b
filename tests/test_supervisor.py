"""The supervisor with real processes: restart after SIGKILL, crash loops, lock, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_check_clean, wait_for

from pipeline import exitcodes
from pipeline.datadir import DataDir

SUPERVISE = Path(__file__).resolve().parent / "procs" / "supervise.py"


def supervise(data_dir: DataDir, *stages: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SUPERVISE), str(data_dir.root), *stages],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def pid_of(data_dir: DataDir, label: str) -> int | None:
    path = data_dir.root / "pids" / label
    return int(path.read_text()) if path.exists() else None


def log_text(data_dir: DataDir, label: str) -> str:
    path = data_dir.log / f"{label}.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture
def broker(data_dir):
    procs = []

    def start(*stages: str) -> subprocess.Popen:
        proc = supervise(data_dir, *stages)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_a_killed_stage_is_restarted_and_sigterm_stops_everything_cleanly(data_dir, broker):
    proc = broker("idle:2")
    first = wait_for(lambda: pid_of(data_dir, "idle-1"), "idle-1 to start")
    wait_for(lambda: pid_of(data_dir, "idle-0"), "idle-0 to start")
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: (p := pid_of(data_dir, "idle-1")) != first and p, "idle-1 to restart")
    assert second != first
    supervisor_log = log_text(data_dir, "supervisor-0")
    assert "stage idle-1 died (signal SIGKILL); restarting it in 0.1 s" in supervisor_log
    assert "restarted stage idle-1" in log_text(data_dir, "supervisor-0")
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.OK, err
    for label in ("idle-0", "idle-1"):
        text = log_text(data_dir, label)
        assert "drained idle work" in text and f"stage {label} stopped" in text
        line = text.splitlines()[0].split()
        assert line[0].endswith("Z") and line[1] == "INFO" and line[2] == label  # timestamp first
    assert "broker stopped cleanly" in log_text(data_dir, "supervisor-0")
    assert_check_clean(data_dir)


def test_a_stage_that_keeps_dying_stops_the_broker_with_one_clear_line(data_dir, broker):
    proc = broker("idle:1", "crash:1")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.STAGE_FAILED
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "fabric: stopping: stage crash-0 died 4 times within 30 s (last: exit code 1)"
    )
    assert "this stage always fails to open" in log_text(data_dir, "crash-0")
    assert "stage idle-0 stopped" in log_text(data_dir, "idle-0")


def test_a_second_broker_on_the_same_data_dir_is_refused(data_dir, broker):
    broker("idle:1")
    wait_for(lambda: pid_of(data_dir, "idle-0"), "the first broker's stage")
    second = broker("idle:1")
    _out, err = second.communicate(timeout=60)
    assert second.returncode == exitcodes.LOCKED
    assert f"data dir {data_dir.root} is in use by pid" in err


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_stages_never_outlive_a_killed_supervisor(data_dir, broker):
    proc = broker("idle:2")
    pids = [
        wait_for(lambda label=label: pid_of(data_dir, label), label)
        for label in ("idle-0", "idle-1")
    ]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in pids), "the orphaned stages to die")
    again = broker("idle:1")  # the lock went with the supervisor: a new broker starts
    wait_for(lambda: pid_of(data_dir, "idle-0") not in (None, pids[0]), "the new broker's stage")
    again.send_signal(signal.SIGTERM)
    _, err = again.communicate(timeout=60)
    assert again.returncode == exitcodes.OK, err
    assert_check_clean(data_dir)


def test_the_last_error_said_is_from_the_stages_last_life_only(tmp_path):
    from pipeline.stage_restarts import last_error_line, log_size

    log = tmp_path / "worker-0.log"
    log.write_text("t ERROR worker-0 1 a problem of an earlier life\n")
    started = log_size(log)
    assert last_error_line(log, started) is None  # killed without a word (SIGKILL)
    with log.open("a") as f:
        f.write("t INFO worker-0 2 up\nt ERROR worker-0 2 engine failed\n")
        f.write('Traceback (most recent call last):\n  File "x", line 1\nValueError: id 30522\n')
    assert last_error_line(log, started) == "ValueError: id 30522"
