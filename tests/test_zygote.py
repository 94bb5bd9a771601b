"""The test harness's forked processes (tests/zygote.py) behave as `subprocess.Popen`'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

SCRIPT = """
import os, sys, threading
print(os.getcwd(), os.environ.get("ZYGOTE_PROBE"), sys.argv[1:], flush=True)
print("from stdin:", sys.stdin.readline().strip(), file=sys.stderr)
pause = threading.Event().wait  # the child's own pauses: one to be killed in, one to outlive
if sys.argv[1] == "sleep":
    pause(60)
threading.Thread(target=lambda: (pause(0.2), print("thread done", flush=True))).start()
raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_streams_cwd_env_argv_threads_and_exit_code(script, tmp_path):
    done = zygote.run(
        [sys.executable, str(script), "7", "x y"],
        input="hello\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "ZYGOTE_PROBE": "seen"},
        timeout=60,
    )
    assert done.returncode == 7  # after its non-daemon thread ended, as the interpreter does
    assert done.stdout.splitlines() == [f"{tmp_path} seen ['7', 'x y']", "thread done"]
    assert done.stderr == "from stdin: hello\n"


def test_signals_timeouts_and_the_command_line_ps_shows(script):
    proc = zygote.Popen([sys.executable, str(script), "sleep"], stdin=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    assert f"{script} sleep" in cmdline
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdin.close()


def test_only_a_python_script_is_forked():
    with pytest.raises(ValueError, match="SCRIPT"):
        zygote.Popen([sys.executable, "-c", "pass"])
