"""Real processes for tests, forked from one that imported the project once.

A broker under test is `python run.py --config FILE`; a worker, `python run.py worker ...`;
a crash test's writer, `python tests/procs/segment_writer.py ...`. Each such process
started from scratch costs a new interpreter and its imports (numpy, pyzmq, the config, the
stage modules): about 0.6 s of CPU each, several hundred times a suite, on the cores the
processes under test need. `Popen([sys.executable, SCRIPT, *ARGS], ...)` from here gives
the same process without that cost: this test process's zygote (a Python started once, the
first time one is asked for, which imported those modules and nothing else, and runs no
thread) forks a child that takes the asked standard streams, working directory,
environment, session and `sys.argv`, then runs SCRIPT as `__main__`, and ends as the
interpreter would (threads joined, `atexit` run, streams flushed).

It is a `subprocess.Popen`: its own pid, signals, exit codes, pipes, `communicate` and
timeouts are those of any child. The one difference is where it starts: its imports are
done, and its parent is the zygote (the zygote reports each exit status to the Popen that
asked). Tests about how a process starts (the demo, first contact, the command line's
exit codes, a machine without the test extras) keep a real interpreter.

The zygote leaves when its test process does (its stdin closes); children it forked run on
until they exit or are killed, as a plain Popen's would.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import pickle
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import setproctitle

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# What a broker, a worker and the crash tests' helpers import, besides the standard library
# (the supervisor's stage table names the rest: pipeline/process/stage.py StageSpec).
PRELOAD = (
    "numpy",
    "zmq",
    "orjson",
    "config",
    "run",
    "assembly.broker",
    "assembly.stages",
    "gpu.engines.registry",
    "gpu.engines.echo",
    "gpu.engines.simulated",
    "gpu.worker.options",
    "gpu.worker.session",
    "collector.results_client",
    "pipeline.transport.broker_client",
    "pipeline.store.datadir",
    "pipeline.store.segment",
    "batches",
)
_STATUS = struct.Struct("!i")  # a pid, then a wait status, each in one message
_lock = threading.Lock()
_server: tuple[subprocess.Popen, str] | None = None


class Popen(subprocess.Popen):
    """`subprocess.Popen([sys.executable, SCRIPT, *ARGS], ...)`, forked by the zygote.

    `pass_fds`, `preexec_fn`, `shell`, user and group changes are not supported (no test
    uses them on these processes); everything else is `subprocess.Popen`'s own."""

    _zygote: socket.socket | None = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):  # fmt: skip
        try:
            args = [os.fspath(a) for a in args]
            if args[0] != sys.executable or len(args) < 2 or args[1].startswith("-"):
                raise ValueError(f"the zygote runs [sys.executable, SCRIPT, ...], not {args}")
            if pass_fds or preexec_fn or shell or executable or uid is not None or gid is not None:
                raise ValueError("the zygote takes no pass_fds, preexec_fn, shell or user")
            request = {
                "argv": args[1:],
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                "env": dict(os.environ if env is None else env),
                "session": bool(start_new_session),
            }
            streams = [p2cread, c2pwrite, errwrite]
            fds = [fd if fd != -1 else own for fd, own in zip(streams, (0, 1, 2), strict=True)]
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(_address())
                socket.send_fds(conn, [pickle.dumps(request)], fds)
                reply = conn.recv(1 << 16)
            except BaseException:
                conn.close()
                raise
            if len(reply) != _STATUS.size:
                conn.close()
                raise OSError(
                    f"the zygote could not start {args}: {reply.decode(errors='replace')}"
                )
            self.pid = _STATUS.unpack(reply)[0]
            self._zygote = conn
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and _ready(self._zygote, 0):
                    self._reap()
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout):
        if not self._waitpid_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            if self.returncode is None:
                if timeout is not None and not _ready(self._zygote, timeout):
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self._reap()
        finally:
            self._waitpid_lock.release()
        return self.returncode

    def _reap(self) -> None:
        conn, self._zygote = self._zygote, None
        try:
            data = conn.recv(_STATUS.size)
        finally:
            conn.close()
        if len(data) != _STATUS.size:  # the zygote died first: the status is lost
            self.returncode = 255
            return
        self._handle_exitstatus(_STATUS.unpack(data)[0])


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """`subprocess.run` with the process forked by the zygote."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except BaseException:
            process.kill()
            process.wait()
            raise
        code = process.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, process.args, stdout, stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


def _ready(conn: socket.socket, timeout: float) -> bool:
    """The zygote has sent the exit status (or gone) within `timeout` seconds."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def close() -> None:
    """Stop this test process's zygote, if it started one (at the end of a session)."""
    global _server
    with _lock:
        if _server is not None:
            proc = _server[0]
            proc.stdin.close()
            proc.wait(timeout=30)
            proc.stdout.close()
            _server = None


def _address() -> str:
    """This test process's zygote (started the first time one is asked for)."""
    global _server
    with _lock:
        if _server is None or _server[0].poll() is not None:
            if _server is not None:  # it died: its pipes, left open, would be ResourceWarnings
                _server[0].stdin.close()
                _server[0].stdout.close()
            address = os.path.join(tempfile.mkdtemp(prefix="fabric-zygote-"), "sock")
            proc = subprocess.Popen(
                [sys.executable, __file__, address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=REPO,
            )
            if proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the zygote did not start (exit code {proc.wait()})")
            _server = (proc, address)
        return _server[1]


# The zygote itself: `python tests/zygote.py ADDRESS`.


def serve(address: str) -> None:
    """Import PRELOAD, then fork a child per request until stdin closes."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as run.py does, before numpy
    base_path = [p for p in sys.path[1:] if p != str(REPO)]
    sys.path[:0] = [str(REPO)]
    sys.path.insert(1, str(TESTS))
    for name in PRELOAD:
        __import__(name)
    for name in _stage_modules():  # what a broker's fork server would import at each life
        __import__(name)
    # setproctitle finds this process's argv and environ now, before a child changes its
    # environment, so a child can show its own command line and a stage its title.
    setproctitle.setproctitle(setproctitle.getproctitle())
    assert threading.active_count() == 1, "a preloaded module started a thread"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    def forget_all() -> None:  # in a child: nothing of the zygote's stays open
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        listener.close()
        for conn in children.values():
            conn.close()
        os.close(wake_r)
        os.close(wake_w)

    try:
        while True:
            for key, _ in selector.select():
                if key.data == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return
                elif key.data == "child":
                    _drain(wake_r)
                    _reap(children)
                else:
                    conn, _ = listener.accept()
                    _start(conn, children, base_path, forget_all)
    finally:
        os.unlink(address)
        os.rmdir(os.path.dirname(address))


def _stage_modules() -> list[str]:
    """The module of each stage in the stage table but the HTTP API's (fastapi: about 0.7 s
    of CPU, for the few brokers that serve it)."""
    from assembly import stages

    refs = [v for k, v in vars(stages).items() if k.isupper() and isinstance(v, str)]
    return [ref.partition(":")[0] for ref in refs if ":" in ref and ref != stages.API]


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # its Popen is gone
                conn.send(_STATUS.pack(status))
            conn.close()


def _start(conn: socket.socket, children, base_path: list[str], forget_all) -> None:
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = pickle.loads(data)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} standard streams sent, not 3")
    except Exception as exc:
        conn.send(f"bad request: {exc!r}".encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; it never returns
        conn.close()
        forget_all()
        _child(request, fds, base_path)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.send(_STATUS.pack(pid))


def _child(request: dict, fds: list[int], base_path: list[str]) -> None:
    """Become `python SCRIPT ARGS` with the asked streams, directory and environment."""
    code = 1
    try:
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            open(1, "wb", closefd=False),  # noqa: SIM115
            write_through=unbuffered,
        )
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            open(2, "wb", closefd=False),  # noqa: SIM115
            errors="backslashreplace",
            line_buffering=True,
        )
        setproctitle.setproctitle(" ".join([sys.executable, *request["argv"]]))  # for ps
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        sys.path[:] = [os.path.dirname(script), *base_path]
        code = 0
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # as the interpreter's exit: non-daemon threads first
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1])
