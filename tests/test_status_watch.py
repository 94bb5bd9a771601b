"""`run.py status --watch`: the dashboard on a pseudo-terminal, plain lines on a pipe.

The end-to-end test runs a real broker whose local worker is the simulated
engine at a known, slow rate, so the job is still running while the
dashboard is read: its screen must show the lane with queued work, the
worker and the job's progress; the plain run must print the same facts with
no escape codes; SIGINT must end both with exit 0. The other tests need no
broker: the line it prints while the broker is down, and the renderers and
data-dir readers driven with fixed inputs.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from broker import REPO, Broker, submit, write_config
from conftest import assert_check_clean, wait_for

from collector.status_sources import JobDirectory, Restart, Snapshot, recent_restarts
from collector.status_watch import plain_lines, rich_view
from gpu.dispatch.item_errors import ItemErrors
from gpu.dispatch.report import idle_fraction
from gpu.dispatch.sessions import Session
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core import exitcodes
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.process.supervisor_report import write_report

ROWS, COLS = 50, 150
TOKENS = 100  # every item: lane 128
ITEMS = 3000
TOKENS_PER_S = 10_000.0  # the simulated worker needs ~30 s for the job: it is running throughout
ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


class Output:
    """Everything a child process wrote to one file descriptor, read without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.raw = b""

    def read(self) -> bytes:
        while select.select([self.fd], [], [], 0)[0]:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:  # EIO: the pty's other side is closed
                break
            if not chunk:
                break
            self.raw += chunk
        return self.raw

    def close(self, proc: subprocess.Popen) -> None:
        """Kill the child if it still runs, reap it, and close our end."""
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        else:
            os.close(self.fd)


def watch_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "run.py", "status", "--watch", "--config", str(config), *extra]


def on_terminal(args: list[str]) -> tuple[subprocess.Popen, Output]:
    """Run `args` with a ROWS x COLS pseudo-terminal as stdin, stdout and stderr."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM")
    }
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env)
    os.close(slave)
    return proc, Output(master)


def on_pipe(args: list[str]) -> tuple[subprocess.Popen, Output]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    return proc, Output(proc.stdout.fileno())


def interrupt(proc: subprocess.Popen, out: Output) -> int:
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: out.read() is not None and proc.poll() is not None, "the watch to exit")
    return proc.returncode


def frames(raw: bytes) -> list[str]:
    """The screens drawn so far, escape codes removed (each redraw starts at the home position)."""
    return [ANSI.sub(b"", f).decode("utf-8", "replace") for f in raw.split(b"\x1b[H")]


@pytest.fixture
def slow_broker(tmp_path):
    config = write_config(tmp_path, workers=1)
    text = config.read_text()
    config.write_text(
        text.replace(
            "[workers]\nlocal = 1\n",
            f'[workers]\nlocal = 1\nengine = "simulated"\nsimulated_tokens_per_s = {TOKENS_PER_S}\n',
        )
    )
    b = Broker(config)
    try:
        yield b.start()
    finally:
        b.close()


def test_watch_draws_lanes_workers_and_job_progress_on_a_terminal_and_plain_on_a_pipe(
    tmp_path, slow_broker
):
    b = slow_broker
    data = tmp_path / "job.jsonl"
    with open(data, "wb") as out:
        for i in range(ITEMS):
            body = {"model": "echo", "prompt_token_ids": list(range(1, TOKENS + 1))}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(orjson.dumps(line) + b"\n")
    result = submit(b.config, data, "--job-id", "watched")
    assert result.returncode == 0, result.stderr
    running: list[tuple[subprocess.Popen, Output]] = []
    try:
        # On a terminal: one screen holds the queued lane, the worker, and the job under way.
        proc, screen = on_terminal(watch_command(b.config))
        running.append((proc, screen))
        lane = re.compile(r"│ echo\s+│ 128\s+│\s+\d+ │\s+\d+ │\s+\d+s │")
        worker = re.compile(r"│ [0-9a-f]{16} │ echo\s+│\s+\d+ │\s+\d+ │\s+\d+ │\s+\d+% │")
        job = re.compile(r"│ watched\s+│ in_progress\s+│ [━╺╸ ]+│\s+[1-9]\d*/3000 \(\d+%\) │\s+0 │")

        def complete_screen() -> str | None:
            return next(
                (
                    f
                    for f in frames(screen.read())
                    if lane.search(f) and worker.search(f) and job.search(f)
                ),
                None,
            )

        shown = wait_for(complete_screen, "a screen with the lane, the worker and the job")
        assert "Lanes" in shown and "Workers" in shown and "Jobs" in shown
        assert screen.raw.startswith(b"\x1b[?1049h") or b"\x1b[?1049h" in screen.raw
        assert interrupt(proc, screen) == exitcodes.OK
        assert screen.raw.rstrip().endswith(b"\x1b[?1049l"), screen.raw[-200:]  # screen restored
        assert b"Traceback" not in screen.raw

        # On a pipe: one block of plain lines per refresh, no escape codes.
        proc, pipe = on_pipe(watch_command(b.config, "--interval", "0.5"))
        running.append((proc, pipe))
        wait_for(lambda: pipe.read().count(b"\n\n") >= 2, "two plain blocks")
        assert interrupt(proc, pipe) == exitcodes.OK
        text = pipe.raw.decode()
        assert "\x1b" not in text
        block = text.split("\n\n")[1].splitlines()
        assert block[0].startswith("== status ") and block[1].startswith("broker in_flight=")
        assert any(
            re.fullmatch(r"lane echo/128 queued=\d+ tokens<=\d+ oldest=\d+s", x) for x in block
        )
        assert any(
            re.match(r"worker [0-9a-f]{16} model=echo batches=\d+ done=\d+ ", x) for x in block
        )
        assert any(
            re.match(r"job watched (queued|in_progress) \d+/3000 \(\d+%\) failed=0", x)
            for x in block
        )
        assert "Traceback" not in text
    finally:
        for proc, out in running:
            out.close(proc)
    assert b.stop() == exitcodes.OK, b.stderr
    assert_check_clean(b.data_dir)


def test_a_broker_that_is_down_is_one_line_and_a_retry_not_a_traceback(tmp_path):
    config = write_config(tmp_path)  # never started
    proc, pipe = on_pipe(watch_command(config, "--timeout", "0.3", "--interval", "0.2"))
    try:
        wait_for(lambda: pipe.read().count(b"retrying") >= 2, "two refreshes saying so")
    finally:
        code = interrupt(proc, pipe)
        pipe.close(proc)
    text = pipe.raw.decode()
    address = re.search(r"dispatch (\S+)", text)[1]
    assert f"note broker not reachable at {address}, retrying" in text
    assert "Traceback" not in text and code == exitcodes.OK


def test_watch_refuses_json_and_a_bad_interval(tmp_path):
    config = write_config(tmp_path)
    for extra in (["--json"], ["--interval", "0"]):
        result = subprocess.run(
            watch_command(config, *extra), capture_output=True, text=True, cwd=REPO, timeout=30
        )
        assert result.returncode == exitcodes.USAGE and "error:" in result.stderr


# ---- the pieces, with fixed inputs -------------------------------------------------------------
def _snapshot(now_ns: int) -> Snapshot:
    broker = {
        "epoch": 7,
        "in_flight": 12,
        "rate_in": 30.0,
        "rate_out": 25.0,
        "dead_lettered": 1,
        "corrupt": 0,
        "queues": [
            {"model": "m", "lane": 64, "queued": 10, "created_ns": now_ns - 90 * 10**9},
            {"model": "m", "lane": 64, "queued": 5, "created_ns": now_ns - 10 * 10**9},
        ],
        "workers": [
            {
                "session": "abcd",
                "model": "m",
                "batches": 2,
                "retired": 50,
                "age_s": 10.0,
                "silent_s": 0.2,
                "idle_fraction": 0.25,
            }
        ],
        "dead_letters": [
            {
                "ns": now_ns,
                "reason": ItemErrorCode.DEAD_LETTERED,
                "job_no": 3,
                "items": 1,
                "segments": [9],
            }
        ],
    }
    job = {
        "job": "j",
        "state": "in_progress",
        "total": 200,
        "completed": 40,
        "failed": 10,
        "pending": 150,
        "rate": 5.0,
        "eta_s": 30.0,
    }
    died = "stage worker-0 died (signal SIGKILL); restarting it in 0.5 s"
    return Snapshot(
        taken_ns=now_ns,
        broker=broker,
        jobs=[job],
        restarts=[Restart(now_ns, "worker-0", died)],
        job_names={3: "poisoned"},
    )


def test_plain_lines_say_each_fact_once_per_line():
    lines = plain_lines(_snapshot(time.time_ns()), "tcp://b:1")
    assert lines[0].startswith("== status ") and lines[0].endswith("dispatch tcp://b:1 epoch 7")
    assert "lane m/64 queued=15 tokens<=960 oldest=90s" in lines  # two segments, summed
    assert "worker abcd model=m batches=2 done=50 rate=5/s idle=25% silent=0.2s" in lines
    assert "job j in_progress 50/200 (25%) failed=10 rate=5/s left=30s" in lines
    assert any(x.startswith("restart ") and x.endswith("restarting it in 0.5 s") for x in lines)
    assert any(x.endswith("job poisoned: 1 item(s) dead_lettered (segment 9)") for x in lines)


def test_rich_view_holds_every_section():
    from rich.console import Console

    console = Console(width=150, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    try:
        console.print(rich_view(_snapshot(time.time_ns()), "tcp://b:1"))
    finally:
        console.file.close()
    text = console.export_text()
    for title in ("Lanes", "Workers", "Jobs", "Recent restarts", "Dead letters"):
        assert title in text
    assert "50/200 (25%)" in text and "25%" in text and "poisoned" in text


def test_restarts_come_from_the_supervisor_report_and_jobs_from_the_data_dir(tmp_path):
    deaths = [
        {"at_ns": 1767323046 * 10**9, "stage": "worker-0", "how": "exit code 1"},
        {"at_ns": 1767323049 * 10**9, "stage": "dispatch-0", "how": "signal SIGKILL"},
    ]
    deaths[0]["restart_in_s"], deaths[1]["restart_in_s"] = 0.5, None  # the broker gave up
    write_report(tmp_path, {"pid": 11, "running": False, "stages": [], "deaths": deaths})
    found = recent_restarts(tmp_path)
    assert [r.stage for r in found] == ["worker-0", "dispatch-0"]
    assert found[0].at_ns == 1767323046 * 10**9
    assert found[0].text == "stage worker-0 died (exit code 1); restarting it in 0.5 s"
    assert recent_restarts(tmp_path / "nowhere") == []

    now = time.time_ns()
    for name, no, finished in (("old", 1, now - 10**12), ("done", 2, now - 10**9), ("run", 3, 0)):
        job = tmp_path / "jobs" / name
        job.mkdir(parents=True)
        (job / "job.json").write_bytes(orjson.dumps({"job_no": no, "created_ns": now - no}))
        if finished:
            (job / "finished").write_text(f"{finished}\n")
    (tmp_path / "jobs" / "half-made").mkdir()  # no job.json yet: skipped
    jobs = JobDirectory(tmp_path)
    shown, hidden = jobs.shown(now)
    assert [e.job_id for e in shown] == ["run", "done"] and hidden == 0  # "old" finished long ago
    assert jobs.names() == {1: "old", 2: "done", 3: "run"}


def test_dispatch_reports_idle_share_and_dead_letters_per_job():
    session = Session(b"s", "m", last_seen=0.0, started=0.0)
    session.idle_marks.extend([(10.0, 2.0), (20.0, 4.5)])
    assert idle_fraction(session, 20.0) == 0.25
    fresh = Session(b"t", "m", last_seen=0.0, started=0.0, idle_s=1.0)
    assert idle_fraction(fresh, 4.0) == 0.25  # no marks yet: over its life

    errors = ItemErrors(3, lambda reason, items: None, collections.Counter(), None)
    items = np.zeros(3, ITEM_DTYPE)
    items["segment"] = [4, 4, 5]
    items["seq"] = [(2 << 32) | 1, (2 << 32) | 7, (3 << 32) | 0]
    errors.note(items, ItemErrorCode.DEAD_LETTERED)
    assert errors.counts[ItemErrorCode.DEAD_LETTERED] == 3
    events = [(e["job_no"], e["items"], e["segments"]) for e in errors.dead_letters]
    assert events == [(2, 2, [4]), (3, 1, [5])]


def test_the_runbook_and_its_examples_match_the_code():
    import run
    from pipeline.process import logs

    docs = REPO / "docs"
    runbook = (docs / "operations.md").read_text()
    status = next(
        a.choices["status"] for a in run.build_parser()._actions if getattr(a, "choices", None)
    )
    for option in ("--watch", "--plain", "--interval", "--json", "--timeout", "--broker"):
        assert option in status._option_string_actions and f"`{option}" in runbook
    for example in (
        "inference-fabric.service",
        "inference-fabric-worker@.service",
        "logrotate.conf",
    ):
        assert (docs / "examples" / example).is_file() and f"docs/examples/{example}" in runbook
    unit = (docs / "examples" / "inference-fabric.service").read_text()
    assert "run.py --config " in unit and "KillMode=mixed" in unit
    rotate = (docs / "examples" / "logrotate.conf").read_text()
    # Rename-and-create rotation is right only because every stage log reopens a moved file.
    assert "copytruncate" not in [line.strip() for line in rotate.splitlines()]
    assert "WatchedFileHandler" in Path(logs.__file__).read_text()
