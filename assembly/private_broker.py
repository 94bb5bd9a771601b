"""A private broker: one a command starts for itself (`run.py demo`, `run.py batch`), talks
to over loopback, and stops when it is done.

| step                  | here                                                          |
|-----------------------|---------------------------------------------------------------|
| its config            | `write_config`: loopback ports picked free, a data dir, models |
| an earlier one's lock | `wait_for_lock`: a broker of an earlier run still draining     |
| start                 | `start_broker`: `run.py --config CFG` as a child              |
| ready                 | `wait_ready`: the front answers (recovery done, stages up)     |
| stop                  | `stop_broker`: SIGTERM, wait for the drain; Ctrl-C again kills |

The broker is `run.py --config CFG` as a child in the command's process group, told
SIGTERM by the kernel if the command dies (PR_SET_PDEATHSIG). It is stopped with SIGTERM and
drains: its local workers finish their batch and hand back the rest while dispatch and
completion still run. Ctrl-C on a terminal reaches the whole group: the supervisor takes it
as SIGTERM (its stages ignore SIGINT and are stopped in order), and the command says it
waits for the drain. A second Ctrl-C kills the broker at once (its stages die with it),
waits until they are gone and removes their shared-memory rings, so that nothing of it is
left running; the next run starts from what was durable.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.core import exitcodes
from pipeline.core.errors import BrokerUnavailableError, FabricError
from pipeline.process.stage_restarts import read_restarts
from pipeline.process.supervisor_report import left_from_last_life
from pipeline.store.datadir import LOCK_NAME
from pipeline.transport.ports import free_loopback_ports
from pipeline.transport.ring import Ring
from pipeline.transport.topology import ring_specs

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 120.0  # for the broker to drain after SIGTERM, before it is killed
GONE_TIMEOUT_S = 10.0  # for the stages of a killed broker to exit (they die with it)
PR_SET_PDEATHSIG = 1


def write_config(
    path: Path,
    header: str,
    data_dir: Path,
    models: list[dict],
    workers: int,
    more: dict[str, dict] | None = None,
    vectors_bind: str | None = None,
    metrics: bool = False,
) -> Path:
    """The config of a private broker at `path` (rewritten each run), `header` its first
    comment: its data dir, `workers` local workers and `models` (each a [[models]] table).
    Its ports are loopback ones picked free, reserved while this process lives
    (pipeline/transport/ports.py): ingest, dispatch and its heartbeat, completion, the vector
    stage (unless `vectors_bind` names its address) and, with `metrics`, the metrics
    endpoint (else none). `more`: other settings, by section."""
    more = more or {}
    ports = iter(free_loopback_ports(4 + (vectors_bind is None) + metrics))

    def loopback() -> str:
        return f"tcp://127.0.0.1:{next(ports)}"

    sections: dict[str, dict] = {
        "broker": {"data_dir": str(data_dir)},
        "ingest": {"bind": loopback()},
        "dispatch": {"bind": loopback(), "heartbeat_bind": loopback(), "reregister_grace_s": 1.0},
        "completion": {"bind": loopback()},
        "vectors": {"bind": vectors_bind or loopback()},
        "metrics": {"bind": f"127.0.0.1:{next(ports)}" if metrics else ""},
        "workers": {"local": workers},
    }
    lines = [f"# {header}"]
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [
            f"{key} = {_toml(value)}" for key, value in {**values, **more.get(name, {})}.items()
        ]
    for model in models:
        lines.append("[[models]]")
        lines += [f"{key} = {_toml(value)}" for key, value in model.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: object) -> str:
    """A TOML value: a JSON string is a TOML basic string, a list of them an array."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return f"[{', '.join(_toml(v) for v in value)}]"
    return json.dumps(str(value))


def wait_for_lock(data_path: Path, say: Callable[[str], None]) -> None:
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


def wait_ready(producer, job_id: str, alive: Callable[[], None], timeout_s: float) -> bool:
    """Ask the broker's front about `job_id` until it answers (recovery done, stages up):
    True then, False after `timeout_s`. `alive` raises when the broker has stopped; a
    `patient` producer (ingest/submit_client.py) waits for a broker that does not listen yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive()
        try:
            producer.job_status(job_id)
            return True
        except BrokerUnavailableError:
            if time.monotonic() > deadline:
                return False


def stop_broker(
    broker: subprocess.Popen,
    settings,
    say: Callable[[str], None] | None = None,
    resumable: bool = True,
) -> int:
    """SIGTERM the broker and wait for it to drain: its exit code. With `say` (after a
    Ctrl-C), say so first, and (`resumable`) that the same command resumes. It is killed
    after STOP_TIMEOUT_S, or at once on a Ctrl-C meanwhile (then -SIGKILL, once its stages
    are gone too)."""
    if broker.poll() is not None:
        return broker.returncode
    if say is not None:
        say(
            f"interrupted: the broker is draining (up to {STOP_TIMEOUT_S:.0f} s; Ctrl-C again "
            f"to stop now)" + ("; run the same command again to resume" if resumable else "")
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
                    "stopped now: the broker was killed"
                    + ("; the same command resumes from what was durable" if resumable else "")
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


def engine_cannot_start(data_path: Path) -> str | None:
    """ "worker-N cannot start its engine: WHY" when a local worker of the broker on
    `data_path` last exited ENGINE_CANNOT_START (the supervisor's report), else None."""
    for worker in read_restarts(data_path):
        if worker["last_exit"] == f"exit code {exitcodes.ENGINE_CANNOT_START}":
            why = str(worker["last_error"]).split("the engine cannot start: ", 1)[-1]
            return f"{worker['stage']} cannot start its engine: {why}"
    return None
