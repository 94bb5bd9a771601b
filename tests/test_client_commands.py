"""tests/client_commands.py: a command run in the test process answers as its subprocess would,
and what it prints stays with the thread that ran it."""

from __future__ import annotations

import sys
import threading

from client_commands import run_cli

from pipeline.core import exitcodes


def test_each_thread_gets_its_own_command_output_and_exit_code(tmp_path):
    before = (sys.stdout, sys.stderr)
    missing = {name: tmp_path / f"{name}.ipc" for name in ("a", "b", "c")}
    done: dict = {}

    def status(name: str) -> None:
        done[name] = run_cli("status", "--broker", f"ipc://{missing[name]}", "--timeout", "0.2")

    threads = [threading.Thread(target=status, args=(name,)) for name in missing]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for name, path in missing.items():
        assert done[name].returncode == exitcodes.UNAVAILABLE, done[name].stderr
        assert str(path) in done[name].stderr  # its own address, no other thread's
        others = [str(p) for n, p in missing.items() if n != name]
        assert not any(other in done[name].stderr for other in others), done[name].stderr
    assert (sys.stdout, sys.stderr) == before  # put back once the last command ended


def test_a_usage_error_is_exit_code_2_with_the_message_on_stderr():
    done = run_cli("status", "--no-such-option")
    assert done.returncode == 2
    assert "--no-such-option" in done.stderr and done.stdout == ""
