"""The stage base: one OS process, one `step(now)` loop, flags set by signals.

A stage is created in its own process (forked from the supervisor's fork
server, which imported the stage modules once), after which `open()` makes
its sockets, maps and shared-memory handles. `run_stage()` then calls
`step(now)` until SIGTERM sets the stop flag (SIGINT is the supervisor's), calls `drain()` to
finish what is in flight, and `close()`. Signal handlers only set flags.
A stage that waits on a `zmq.Poller` named `self.poller` is woken by the
signal itself: `run_stage` adds the signal wake pipe to it
(pipeline/process/signal_wake.py), so a broker's stop does not wait out each stage's
idle timeout in turn (4.2 s for a whole broker before, 0.3 s after). Tests
drive `step(now)` one call at a time.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import zmq

from pipeline.core.errors import DiskFullError
from pipeline.process.logs import setup_stage_logging
from pipeline.process.signal_wake import SignalWake
from pipeline.telemetry.metrics import StatsPusher
from pipeline.transport.topology import stage_label

log = logging.getLogger("fabric.stage")
PR_SET_PDEATHSIG = 1
# EX_TEMPFAIL: a DiskFullError reached the top of a stage (stages handle a full disk; this
# is the safety net). The supervisor restarts it without counting a crash.
DISK_FULL_EXIT = 75


class MetricsConfig(Protocol):
    """How a stage reports its figures (`[metrics]`, pipeline/telemetry/metrics.py StatsPusher)."""

    @property
    def bind(self) -> str: ...
    @property
    def interval_s(self) -> float: ...


class StageConfig(Protocol):
    """What every stage's settings hold (config/stage_settings.py): the data dir, for its
    log, files and ipc sockets, and how it reports its figures."""

    @property
    def data_path(self) -> Path: ...
    @property
    def metrics(self) -> MetricsConfig: ...


SettingsT = TypeVar("SettingsT", bound=StageConfig)


@dataclass(frozen=True)
class StageSpec:
    """What the supervisor starts: stage `name`, instance `index`, of the class that `stage`
    names, `"module:Class"`, with `settings`, that stage's own frozen part of the config
    (config/stage_settings.py; built by the stage table, which names the stages).

    The stage table (assembly/stages.py) names the classes by reference; the ground floor
    names none. So the supervisor never imports a stage module (about 0.4 s of CPU at every
    broker start): the fork server the stages come from imports them, and the stage process
    resolves the reference (`stage_class`).
    """

    name: str
    index: int
    stage: str  # "module:Class"
    settings: Any  # a StageConfig: the stage class's own settings type
    critical: bool = True  # a crash loop of a critical stage stops the broker; others (local
    # workers) are restarted forever, with backoff (pipeline/process/supervisor.py)

    @property
    def label(self) -> str:
        return stage_label(self.name, self.index)

    @property
    def module(self) -> str:
        """The module that defines the stage class."""
        return self.stage.partition(":")[0]

    def stage_class(self) -> type[Stage]:
        module, _, name = self.stage.partition(":")
        return getattr(importlib.import_module(module), name)


class Stage(Generic[SettingsT]):
    """Base class. Subclasses override `open`, `step`, `drain` and `close`, and name their
    settings type: `class FrontStage(Stage[FrontStageSettings])`.

    Contract: `step(now)` does one bounded unit of work and returns within
    about `poll_ms` when idle; it never sleeps unboundedly. `drain(deadline)`
    finishes in-flight work before the monotonic `deadline`. `epoch` is the broker life's
    (the supervisor's start, ns; 0 for a stage run alone): an argument, not a setting.
    """

    name: ClassVar[str] = "stage"
    poll_ms: ClassVar[int] = 100
    # the poller the stage's step waits on, if any: run_stage adds the signal wake pipe to it
    poller: zmq.Poller | None = None

    def __init__(self, settings: SettingsT, index: int, epoch: int = 0) -> None:
        self.settings = settings
        self.index = index
        self.epoch = epoch
        self.log = logging.getLogger(f"fabric.{self.name}")

    @property
    def label(self) -> str:
        return stage_label(self.name, self.index)

    def open(self) -> None:
        """Create sockets, maps and handles (in the child process)."""

    def step(self, now: float) -> None:
        """One unit of work; blocks at most about `poll_ms` when there is none."""
        raise NotImplementedError

    def drain(self, deadline: float) -> None:
        """Finish in-flight work before `deadline` (monotonic seconds)."""

    def close(self) -> None:
        """Release everything `open()` made."""

    def stats(self, now: float) -> dict | None:
        """Figures for the metrics endpoint, or None: {metric name: value} (pipeline/telemetry/metrics.py).

        Called on the stage's own thread every `metrics.interval_s`; keep it cheap.
        """
        return None


class StopFlags:
    """SIGTERM and SIGINT set `stop` (handlers only set the flag); for stages and workers.

    With `interrupt=False` (a stage under a supervisor) SIGINT is ignored: Ctrl-C on a
    terminal reaches every process of the foreground group, and a stage that stopped on it
    by itself would not wait for its turn. The supervisor takes it as SIGTERM and stops the
    stages in order, so a local worker drains while dispatch and completion still take its
    results (stopping all at once, it waited `workers.drain_s` for answers that never came).
    """

    stop = False

    def __init__(self, interrupt: bool = True) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop if interrupt else signal.SIG_IGN)

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stop = True


def set_title(title: str) -> None:
    """What `ps` shows for this process: `fabric: <stage>-<n>`, and the fork server's."""
    try:
        import setproctitle
    except ImportError:  # a cosmetic nicety; the process works without it
        return
    setproctitle.setproctitle(title)


def run_stage(spec: StageSpec, epoch: int, drain_s: float = 30.0, ready=None) -> int:
    """Entry point of a stage process: set up, loop until asked to stop, drain, exit 0.
    `epoch` is the broker life's; `ready` (a multiprocessing Event) is set once the stage
    is open: it is up."""
    settings: StageConfig = spec.settings
    set_title(f"fabric: {spec.label}")
    setup_stage_logging(settings.data_path / "log", spec.label)
    flags = StopFlags(interrupt=False)  # the supervisor stops its stages, in order
    stage = spec.stage_class()(settings, spec.index, epoch)
    stage.open()
    log.info("stage %s up", spec.label)
    if ready is not None:
        ready.set()
    pusher = StatsPusher(settings, spec.label)
    wake = SignalWake()
    poller = stage.poller
    woken = wake.fd is not None and poller is not None
    if woken:  # SIGTERM ends the stage's wait at once, not at its timeout
        poller.register(wake.fd, zmq.POLLIN)
    try:
        while not flags.stop:
            now = time.monotonic()
            stage.step(now)
            pusher.maybe_push(stage, now)
        if woken:  # readable from now on: drain's waits are its own
            poller.unregister(wake.fd)
        log.info("stage %s draining", spec.label)
        stage.drain(time.monotonic() + drain_s)
    finally:
        pusher.close()
        wake.close()
        stage.close()
    log.info("stage %s stopped", spec.label)
    return 0


def die_with_parent(supervisor_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux prctl).

    A stage must never outlive its broker: a new broker on the same data dir
    would otherwise meet a second writer. Its parent is the supervisor's fork
    server, which exits once every holder of its "alive" pipe has closed it:
    the supervisor, and each process it forked, which inherits a copy. So the
    stage closes its copy here; when the supervisor dies, the fork server sees
    the pipe end, exits, and the stage dies with it (tests/test_supervisor.py
    kills a supervisor and checks).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the module's one ForkServer (CPython 3.8 and later)
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent or not _alive(supervisor_pid):  # died before prctl took effect
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has taken the pid: ours is gone
        return False
    return True


def stage_main(
    spec: StageSpec, epoch: int, parent_pid: int, ready=None
) -> None:  # pragma: no cover - child
    """multiprocessing target: exit with the stage's code; a crash logs and exits 1."""
    die_with_parent(parent_pid)
    try:
        code = run_stage(spec, epoch, ready=ready)
    except DiskFullError:
        log.exception("stage %s stopped on a full disk", spec.label)
        code = DISK_FULL_EXIT
    except Exception:
        log.exception("stage %s crashed", spec.label)
        code = 1
    sys.exit(code)
