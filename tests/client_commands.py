"""`run.py` client commands run inside the test process, with what they print captured.

A client command in a subprocess costs a new interpreter and its imports (about 0.65 CPU-s,
on cores the brokers under test need); `run_cli` calls `run.main` instead and answers as
`subprocess.run(..., capture_output=True, text=True)` would. Tests about the command line
itself (how a process starts, exits, or is killed) keep a real subprocess.

What the command prints goes to a buffer of the thread that runs it (a test may run `submit`
in a thread while its own thread kills a stage); other threads print where they did before.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading

_local = threading.local()
_lock = threading.Lock()
_users = 0
_saved: tuple | None = None


class _ThreadStream(io.TextIOBase):
    """sys.stdout or sys.stderr while a command runs: the running thread's buffer, or the
    stream that was there before for any other thread."""

    def __init__(self, name: str, fallback) -> None:
        self.name_ = name
        self.fallback = fallback

    def _target(self):
        return getattr(_local, self.name_, None) or self.fallback

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False  # as a captured subprocess: no terminal

    def writable(self) -> bool:
        return True


def _install() -> None:
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = (sys.stdout, sys.stderr)
            sys.stdout = _ThreadStream("out", sys.stdout)
            sys.stderr = _ThreadStream("err", sys.stderr)
        _users += 1


def _uninstall() -> None:
    global _users, _saved
    with _lock:
        _users -= 1
        if _users == 0 and _saved is not None:
            sys.stdout, sys.stderr = _saved
            _saved = None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python run.py ARGS`, run in this process: its exit code and what it printed."""
    import run

    out, err = io.StringIO(), io.StringIO()
    _local.out, _local.err = out, err
    _install()
    try:
        try:
            code = run.main(list(args))
        except SystemExit as exc:  # argparse's usage errors, --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            if exc.code is not None and not isinstance(exc.code, int):
                err.write(f"{exc.code}\n")
    finally:
        _uninstall()
        _local.out = _local.err = None
    return subprocess.CompletedProcess(
        ["run.py", *args], int(code or 0), out.getvalue(), err.getvalue()
    )
