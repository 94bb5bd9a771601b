"""The fork server the stage processes come from, started as a fork of the supervisor.

Stages are started with multiprocessing's "forkserver" method: a single-threaded
process that imported the stage modules once forks each stage, so a stage start
costs a fork, not an interpreter, and never copies the supervisor's threads
(heartbeat, metrics) or their locks. multiprocessing starts that server as a
fresh interpreter which imports numpy, pyzmq, the config and every stage module
again: about 0.5 s of CPU at every broker start, all of it already done by the
supervisor.

`start_forked(preload)` starts the same server (multiprocessing's own
`forkserver.main`, speaking its own protocol) as a fork of the supervisor
instead, while the supervisor is still single-threaded and before it opens
anything of its own (the data dir lock, its log file): the server begins with
what the supervisor imported and imports only the rest of `preload`. It is
registered as multiprocessing's fork server, so `Process.start()` and every
rule of that method stay as they were: a stage gets its own copy of the
"alive" pipe and of the resource tracker's fd (the tracker, too, is a fork
made here: "fabric: resource-tracker"), the server exits once every
holder of the pipe has closed it, and a server that died is started again the
ordinary way by `forkserver.ensure_running()`.

In the server, SIGTERM, SIGINT and SIGHUP go back to their defaults (the
supervisor's handlers only set the supervisor's flags), `ps` shows it as
"fabric: fork-server", and nothing the supervisor registered at exit runs: it
leaves by `os._exit`.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from multiprocessing import connection, forkserver, resource_tracker

from pipeline.process.stage import set_title

_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def start_forked(preload: list[str]) -> int | None:
    """Start multiprocessing's fork server as a fork of this process; its pid.

    None, and nothing started, where a fork would not be safe (a thread runs besides
    this one) or a server already runs: `forkserver.ensure_running()` then starts
    one the ordinary way (a fresh interpreter), as the first stage start would.
    """
    server = forkserver._forkserver  # the module's one ForkServer (CPython 3.8 and later)
    if server._forkserver_pid is not None or threading.active_count() > 1:
        return None
    tracker = resource_tracker._resource_tracker
    if tracker._fd is None:  # the stages get its fd from each start request
        read, write = os.pipe()
        pid = _fork("fabric: resource-tracker", lambda: resource_tracker.main(read), [write])
        os.close(read)
        tracker._fd, tracker._pid = write, pid
    listener = socket.socket(socket.AF_UNIX)
    try:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()

        def serve() -> None:
            tracker._fd = None  # closed by _fork: each stage gets its own with its request
            forkserver.main(listener.fileno(), alive_r, preload)

        # Only the supervisor and its stages hold the alive pipe open.
        pid = _fork("fabric: fork-server", serve, [alive_w, tracker._fd])
        os.close(alive_r)
    finally:
        listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return pid


def _fork(title: str, body, close: list[int]) -> int:
    """Fork a child that closes `close`, puts SIGTERM, SIGINT and SIGHUP back to their
    defaults, takes `title` and runs `body` (multiprocessing's own loop: the resource
    tracker ignores SIGINT and SIGTERM itself), then leaves by `os._exit`; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0  # pragma: no cover - the child; it never returns
    try:
        for fd in close:
            os.close(fd)
        for signum in _DEFAULT_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        set_title(title)
        body()
    except SystemExit:  # the fork server's normal end: every holder of its alive pipe closed it
        pass
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    finally:
        sys.stderr.flush()
        os._exit(code)
