"""The private broker of `run.py batch` (collector/oneshot.py): start it, wait for an earlier
one to let go of the data dir, stop it.

The broker is `run.py --config CFG` as a child in the batch command's process group, told
SIGTERM by the kernel if the batch command dies (PR_SET_PDEATHSIG). It is stopped with
SIGTERM and drains: its local workers finish their batch and hand back the rest while
dispatch and completion still run. Ctrl-C on a terminal reaches the whole group: the
supervisor takes it as SIGTERM (its stages ignore SIGINT and are stopped in order), and the
batch command says it waits for the drain. A second Ctrl-C kills the broker at once (its
stages die with it), waits until they are gone and removes their shared-memory rings, so
that nothing of it is left running; the next run resumes from what was durable.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.core.errors import FabricError
from pipeline.process.supervisor_report import left_from_last_life
from pipeline.store.datadir import LOCK_NAME
from pipeline.transport.ring import Ring
from pipeline.transport.topology import ring_specs

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 120.0  # for the broker to drain after SIGTERM, before it is killed
GONE_TIMEOUT_S = 10.0  # for the stages of a killed broker to exit (they die with it)
PR_SET_PDEATHSIG = 1


def wait_for_lock(data_path: Path, say) -> None:
    """Return once no process holds the data dir's lock (an earlier run's broker draining)."""
    lock = data_path / LOCK_NAME
    if not lock.exists():
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    told = False
    fd = os.open(lock, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FabricError(
                        f"data dir {data_path} is still locked after {STOP_TIMEOUT_S:.0f} s by "
                        f"pid {lock.read_text().strip() or '?'}; stop that broker and run again"
                    ) from None
                if not told:
                    say(f"waiting for the broker of an earlier run on {data_path} to stop")
                    told = True
                time.sleep(0.2)  # a process is draining: look again
    finally:
        os.close(fd)


def _term_with_parent() -> None:  # runs in the broker child between fork and exec
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_broker(config: Path, err_path: Path) -> subprocess.Popen:
    """`run.py --config CONFIG`, its stderr appended to `err_path`."""
    with open(err_path, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(REPO / "run.py"), "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,  # runs in this working directory: --config's relative paths mean the same
            preexec_fn=_term_with_parent,
        )


def stop_broker(broker: subprocess.Popen, settings, say=None) -> int:
    """SIGTERM the broker and wait for it to drain: its exit code. With `say` (after a
    Ctrl-C), say so first. It is killed after STOP_TIMEOUT_S, or at once on a Ctrl-C meanwhile
    (then -SIGKILL, once its stages are gone too)."""
    if broker.poll() is not None:
        return broker.returncode
    if say is not None:
        say(
            f"interrupted: the broker is draining (up to {STOP_TIMEOUT_S:.0f} s; Ctrl-C again "
            f"to stop now); run the same command again to resume"
        )
    killed: list[bool] = []

    def kill_now(signum: int, frame: object) -> None:
        killed.append(True)
        broker.kill()

    handling = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, kill_now) if handling else None
    try:
        broker.send_signal(signal.SIGTERM)
        try:
            code = broker.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            broker.kill()
            killed.append(True)
            code = broker.wait()
        if killed:
            _clear_after_kill(settings)
            if say is not None:
                say(
                    "stopped now: the broker was killed; the same command resumes from what was durable"
                )
    finally:
        if handling:
            signal.signal(signal.SIGINT, previous)
    return code


def _clear_after_kill(settings) -> None:
    """Wait for the stages of a killed broker to exit, then remove its rings (its supervisor
    would have; the next broker on the data dir would replace them)."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while left_from_last_life(settings.data_path) and time.monotonic() < deadline:
        time.sleep(0.05)  # they die with their fork server, a moment after the supervisor
    for ring in ring_specs(settings):
        Ring.unlink(ring.name)
