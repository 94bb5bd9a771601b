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
from multiprocessing import connection, forkserver, resource_tracker, util

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
    _start_tracker()  # the stages get its fd from each start request
    listener = socket.socket(socket.AF_UNIX)
    try:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the server; it never returns
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
    finally:
        listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return pid


def _start_tracker() -> None:
    """multiprocessing's resource tracker (which unlinks the named semaphores of processes
    that die without doing it), forked like the server instead of a fresh interpreter."""
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        return
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the tracker; it never returns
        code = 0
        try:
            os.close(write)  # it ends when every process holding the write end has closed it
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            _set_title("fabric: resource-tracker")
            resource_tracker.main(read)  # ignores SIGINT and SIGTERM itself
        except BaseException:
            code = 1
            sys.excepthook(*sys.exc_info())
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(read)
    tracker._fd, tracker._pid = write, pid


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str]) -> None:
    """The forked server: multiprocessing's own loop, then `os._exit`."""
    code = 0
    try:
        os.close(alive_w)  # only the supervisor and its stages hold the pipe open
        tracker = resource_tracker._resource_tracker
        if tracker._fd is not None:  # each stage gets its own copy with its start request
            os.close(tracker._fd)
            tracker._fd = None
        for signum in _DEFAULT_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        _set_title("fabric: fork-server")
        forkserver.main(listener_fd, alive_r, preload)
    except SystemExit:  # every holder of the alive pipe closed it: the normal end
        pass
    except BaseException:
        code = 1
        util.debug("forked fork server failed", exc_info=True)
        sys.excepthook(*sys.exc_info())
    finally:
        sys.stderr.flush()
        os._exit(code)


def _set_title(title: str) -> None:
    """What `ps` shows for this process (else the supervisor's command line)."""
    try:
        import setproctitle
    except ImportError:  # a cosmetic nicety, as for the stages
        return
    setproctitle.setproctitle(title)
