"""The supervisor with real processes: restart after SIGKILL, crash loops, lock, SIGTERM.

Tests read what the supervisor reports (`<data_dir>/supervisor.json`), the files its test
stages write (tests/procs/stages.py) and process exits, never its log's wording."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from conftest import assert_check_clean, wait_for

from pipeline.core import exitcodes
from pipeline.process.supervisor_report import read_report
from pipeline.store.datadir import DataDir
from pipeline.transport.topology import run_dir_path

SUPERVISE = Path(__file__).resolve().parent / "procs" / "supervise.py"


def supervise(data_dir: DataDir, *stages: str, env: dict | None = None) -> subprocess.Popen:
    return zygote.Popen(
        [sys.executable, str(SUPERVISE), str(data_dir.root), *stages],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def pid_of(data_dir: DataDir, label: str) -> int | None:
    path = data_dir.root / "pids" / label
    return int(path.read_text()) if path.exists() else None


def log_text(data_dir: DataDir, label: str) -> str:
    path = data_dir.log / f"{label}.log"
    return path.read_text() if path.exists() else ""


def drained(data_dir: DataDir, label: str) -> bool:
    return (data_dir.root / "drained" / label).exists()


def stage_report(data_dir: DataDir, label: str) -> dict:
    report = read_report(data_dir.root)
    assert report is not None, f"no {data_dir.root}/supervisor.json"
    return next(s for s in report["stages"] if s["stage"] == label)


@pytest.fixture
def broker(data_dir):
    procs = []

    def start(*stages: str, env: dict | None = None) -> subprocess.Popen:
        proc = supervise(data_dir, *stages, env=env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.slow
def test_a_killed_stage_is_restarted_and_sigterm_stops_everything_cleanly(data_dir, broker):
    proc = broker("idle:2")
    first = wait_for(lambda: pid_of(data_dir, "idle-1"), "idle-1 to start")
    wait_for(lambda: pid_of(data_dir, "idle-0"), "idle-0 to start")
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: (p := pid_of(data_dir, "idle-1")) != first and p, "idle-1 to restart")
    assert second != first
    wait_for(lambda: stage_report(data_dir, "idle-1")["pid"] == second, "the report of idle-1")
    report = read_report(data_dir.root)
    assert [(d["stage"], d["how"], d["restart_in_s"]) for d in report["deaths"]] == [
        ("idle-1", "signal SIGKILL", 0.1)
    ]
    assert stage_report(data_dir, "idle-1")["restarts"] == 1
    assert stage_report(data_dir, "idle-0")["restarts"] == 0
    assert run_dir_path(data_dir.root).is_dir()  # its metrics thread's ipc socket is there
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.OK, err
    assert not run_dir_path(data_dir.root).exists()  # a clean stop leaves no ipc directory
    report = read_report(data_dir.root)
    assert not report["running"]
    assert {s["stage"]: (s["state"], s["pid"]) for s in report["stages"]} == {
        "idle-0": ("stopped", 0),
        "idle-1": ("stopped", 0),
    }
    for label in ("idle-0", "idle-1"):
        assert drained(data_dir, label)
        line = log_text(data_dir, label).splitlines()[0].split()  # the log's format, for people
        assert line[0].endswith("Z") and line[1] == "INFO" and line[2] == label  # timestamp first
    assert_check_clean(data_dir)


@pytest.mark.slow
def test_a_stage_that_keeps_dying_stops_the_broker_with_one_clear_line(data_dir, broker):
    proc = broker("idle:1", "crash:1")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.STAGE_FAILED
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "fabric: stopping: stage crash-0 died 4 times within 30 s (last: exit code 1)"
    )
    crash = stage_report(data_dir, "crash-0")
    assert crash["last_error"] == "RuntimeError: this stage always fails to open"
    assert (crash["deaths"], crash["state"]) == (4, "stopped")
    assert drained(data_dir, "idle-0")


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


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def open_files(pid: int) -> list[str]:
    fds = Path(f"/proc/{pid}/fd")
    return [os.readlink(fd) for fd in fds.iterdir()]


@pytest.mark.slow
def test_stages_never_outlive_a_killed_supervisor(data_dir, broker):
    proc = broker("idle:2")
    pids = [
        wait_for(lambda label=label: pid_of(data_dir, label), label)
        for label in ("idle-0", "idle-1")
    ]
    # The stages come from one fork server, a fork of the supervisor (pipeline/process/fork_server.py)
    # that holds none of its files: not the data dir's lock, not its log.
    server = parent_of(pids[0])
    assert parent_of(pids[1]) == server and parent_of(server) == proc.pid
    assert Path(f"/proc/{server}/cmdline").read_bytes().startswith(b"fabric: fork-server")
    held = [f for f in open_files(server) if f.startswith(str(data_dir.root))]
    assert held == [], held
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in [*pids, server]), "the orphaned stages to die")
    again = broker("idle:1")  # the lock went with the supervisor: a new broker starts
    wait_for(lambda: pid_of(data_dir, "idle-0") not in (None, pids[0]), "the new broker's stage")
    again.send_signal(signal.SIGTERM)
    _, err = again.communicate(timeout=60)
    assert again.returncode == exitcodes.OK, err
    assert_check_clean(data_dir)


def test_the_last_error_said_is_from_the_stages_last_life_only(tmp_path):
    from pipeline.process.stage_restarts import last_error_line, log_size

    log = tmp_path / "worker-0.log"
    log.write_text("t ERROR worker-0 1 a problem of an earlier life\n")
    started = log_size(log)
    assert last_error_line(log, started) is None  # killed without a word (SIGKILL)
    with log.open("a") as f:
        f.write("t INFO worker-0 2 up\nt ERROR worker-0 2 engine failed\n")
        f.write('Traceback (most recent call last):\n  File "x", line 1\nValueError: id 30522\n')
    assert last_error_line(log, started) == "ValueError: id 30522"


def test_status_lists_from_the_report_only_local_workers_that_died(tmp_path):
    from pipeline.process.stage_restarts import read_restarts
    from pipeline.process.supervisor_report import write_report

    def stage(label: str, critical: bool, deaths: int, state: str, at_ns: int = 0) -> dict:
        return {
            "stage": label,
            "pid": 0 if state == "restarting" else 7,
            "state": state,
            "critical": critical,
            "restarts": deaths,
            "deaths": deaths,
            "deaths_in_a_row": deaths,
            "last_exit": "signal SIGKILL" if deaths else "",
            "last_error": None,
            "restart_at_ns": at_ns,
        }

    stages = [
        stage("writer-0", True, 2, "up"),  # a critical stage: not a local worker
        stage("worker-0", False, 3, "restarting", at_ns=10 * 10**9),
        stage("worker-1", False, 0, "up"),  # never died
        stage("worker-2", False, 1, "up"),
    ]
    write_report(tmp_path, {"pid": 1, "running": True, "stages": stages, "deaths": []})
    found = read_restarts(tmp_path, now_ns=6 * 10**9)
    assert [(s["stage"], s["state"], s["restart_in_s"]) for s in found] == [
        ("worker-0", "restarting", 4.0),
        ("worker-2", "running", 0.0),
    ]
    write_report(tmp_path, {"pid": 1, "running": False, "stages": stages, "deaths": []})
    assert read_restarts(tmp_path) == []  # a stopped broker's report says nothing of now
    assert read_restarts(tmp_path / "nowhere") == []


def test_a_broker_started_right_after_a_kill_waits_for_the_last_lifes_stages(tmp_path):
    """The stages of a broker life just killed die with it, but not at once, and hold its
    ports meanwhile. A new broker started at once must wait for them (the last report names
    their pids), not refuse its ports as taken by another program."""
    import threading

    import orjson
    from broker import Broker, write_config

    config = write_config(tmp_path)
    b = Broker(config, stderr_path=tmp_path / "broker.err")
    host, port = b.settings.ingest.bind[len("tcp://") :].rsplit(":", 1)
    holder = subprocess.Popen(  # the last life's front, still exiting: it holds ingest.bind
        [
            sys.executable,
            "-c",
            "import socket, sys; s = socket.socket(); "
            f"s.bind(({host!r}, {port})); s.listen(); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lock = b.data_dir.root / "broker.lock"
    try:
        assert holder.stdout.readline().strip() == "held"
        b.data_dir.root.mkdir(parents=True, exist_ok=True)
        report = {"pid": 1, "epoch": 1, "running": True, "ready": True, "deaths": []}
        report["stages"] = [{"stage": "front-0", "pid": holder.pid, "state": "up"}]
        (b.data_dir.root / "supervisor.json").write_bytes(orjson.dumps(report))
        starting = threading.Thread(target=b.start, daemon=True)
        starting.start()
        wait_for(
            lambda: (
                b.proc is not None and lock.exists() and lock.read_text().strip() == str(b.proc.pid)
            ),
            "the new broker to take the data dir's lock",
        )
        assert b.proc.poll() is None and not b.all_up()  # it waits for the last life's front
        holder.stdin.close()  # which exits now
        starting.join(60)
        assert b.all_up(), (tmp_path / "broker.err").read_text()
        assert b.stop() == exitcodes.OK, (tmp_path / "broker.err").read_text()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        b.close()


def test_sigterm_ends_an_idle_supervisors_wait_at_once(data_dir, broker):
    """An idle supervisor sleeps until a stage exits or something is due (pipeline/process/supervisor.py
    `_wait_s`); a signal must end that sleep, not the next timeout: here the longest idle wait
    is 60 s, and the broker must have stopped well before."""
    proc = broker("idle:1", env={"FABRIC_TEST_IDLE_WAIT_S": "60"})
    took = sigterm_once_up(proc, data_dir, "idle-0")
    assert took < 10, f"SIGTERM to exit took {took:.1f} s"


def sigterm_once_up(proc: subprocess.Popen, data_dir, label: str) -> float:
    """SIGTERM to the supervisor once stage `label` is reported up (its loop has left its
    20 ms looks at a starting stage for its idle wait); the seconds to a clean exit, the
    stage drained."""
    wait_for(lambda: pid_of(data_dir, label), f"{label} to start")
    wait_for(lambda: stage_report(data_dir, label)["state"] == "up", f"{label} to be up")
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=90)
    took = time.monotonic() - asked
    assert proc.returncode == exitcodes.OK, err
    assert drained(data_dir, label)
    return took


def test_sigterm_ends_a_stages_wait_on_its_poller_at_once(data_dir, broker):
    """A stage waiting on `self.poller` is woken by SIGTERM itself (run_stage adds the signal
    wake pipe to its poller), not at its timeout: here each wait is a minute long. A broker's
    stages stop one after another, so their idle timeouts added up: 4.2 s for every stop."""
    took = sigterm_once_up(broker("polling:1"), data_dir, "polling-0")
    assert took < 10, f"SIGTERM to exit took {took:.1f} s (a step waits 60 s)"


def open_semaphores(pid: int) -> dict[str, bool]:
    """The named POSIX semaphores process `pid` has open (sem_open maps /dev/shm/sem.NAME), as
    name -> whether the name was unlinked already."""
    found = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, mode, offset, device, inode, path
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/dev/shm/sem."):
            unlinked = path.endswith(" (deleted)")
            found[path.removesuffix(" (deleted)").removeprefix("/dev/shm/")] = unlinked
    return found


def test_a_clean_stop_leaves_no_semaphore_behind_and_no_leak_warning(tmp_path):
    """A stage's ready event is five named semaphores (multiprocessing's forkserver method);
    the supervisor releases it once the stage is up, so a SIGTERM leaves none in /dev/shm
    and nothing for the resource tracker to report as "leaked semaphore objects"."""
    from broker import Broker, write_config

    b = Broker(write_config(tmp_path))  # stderr on a pipe: read to its end, the tracker's too
    try:
        b.start()
        stages = b.pids()
        opened = {}
        for pid in stages.values():
            opened |= open_semaphores(pid)
        assert len(opened) >= len(stages)  # each stage opened its ready event's
        assert [name for name, unlinked in opened.items() if not unlinked] == []
        assert open_semaphores(b.proc.pid) == {}  # the supervisor let go of every one
        assert b.stop() == exitcodes.OK, b.stderr
        assert "leaked" not in b.stderr and "resource_tracker" not in b.stderr, b.stderr
        assert [n for n in opened if Path("/dev/shm", n).exists()] == []
    finally:
        b.close()


SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2): the calling thread alone, not the process


@pytest.mark.skipif(platform.machine() not in SYS_EXIT, reason="exit(2)'s number on this CPU")
def test_a_stage_whose_main_thread_is_a_zombie_is_waited_for_until_its_threads_exit(tmp_path):
    """A killed stage shows its main thread as a zombie at once, while ZeroMQ's I/O thread,
    which owns its listening sockets, may still be exiting: the ports are free only once the
    last thread is gone. A new broker life waits for such a stage as for a running one (it
    once found the port in use, restarted within milliseconds of a whole-broker kill)."""
    import orjson

    from pipeline.process.supervisor_report import left_from_last_life

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ctypes, socket, threading, time; s = socket.socket(); "
            "s.bind(('127.0.0.1', 0)); s.listen(); "
            "threading.Thread(target=time.sleep, args=(3600,)).start(); print('held', flush=True); "
            f"ctypes.CDLL(None).syscall({SYS_EXIT[platform.machine()]}, 0)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        stat = Path(f"/proc/{holder.pid}/stat")
        wait_for(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "a zombie leader")
        report = {"pid": 1, "epoch": 1, "running": True, "ready": True, "deaths": []}
        report["stages"] = [{"stage": "dispatch-0", "pid": holder.pid, "state": "up"}]
        (tmp_path / "supervisor.json").write_bytes(orjson.dumps(report))
        assert left_from_last_life(tmp_path) == [holder.pid]  # its thread holds the port
        holder.kill()
        holder.wait(timeout=30)
        assert left_from_last_life(tmp_path) == []
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
