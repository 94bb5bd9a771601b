"""The supervisor: lock the data dir, recover, then start, watch and restart every stage.

`python run.py --config FILE` runs one Supervisor. Order of business:

1. Refuse a bind beyond loopback that nothing authenticates, and unreadable
   keys (pipeline/transport/security.py; exit 3); set the umask to 0o077, so every file
   the broker and its stages create is the owner's alone. Fork the fork server
   the stages come from (pipeline/process/fork_server.py: it imports the stage modules
   meanwhile). Take the data dir's
   exclusive lock (a second broker on it exits 4); wait (up to 10 s) for the
   stages of a broker life killed a moment ago, still exiting and holding its
   ports (their pids in the last report); check what would stop a
   stage at start (pipeline/process/preflight.py: files the config names load, ports
   are free; exit 3 with the cause); start the heartbeat port and the metrics thread
   (pipeline/telemetry/metrics_server.py), whose /live and /ready answer from `health`,
   which each turn of the loop feeds (pipeline/telemetry/health.py).
2. Run recovery (invariant 4), then `after_recovery` when it found damage,
   and hand finished segments to the collector.
3. Create the shared-memory rings between stages, then start every stage
   as its own process, in pipeline order, and say on stderr what it
   serves (pipeline/process/announce.py); "ready" once every stage set its ready
   event, and the last error line of one that dies before it was up. A stage that dies has its
   rings replaced before it restarts (what they held is dropped: the front
   times those chunks out and producers send them again).
4. Loop on `step(now)`, sleeping in between until a stage exits, a signal
   arrives or a restart, collector retry or sweep is due (at most
   IDLE_WAIT_S): a stage that died is logged (which, exit code or
   signal) and restarted after a backoff that doubles with each recent
   death; more than `supervisor.max_restarts` deaths of one stage within
   `restart_window_s` stop the broker with exit code 5 and one clear line.
   A local worker is never given up on (its engine may die on one poison
   item, which dispatch dead-letters after `max_attempts` deaths): it is
   restarted after a backoff that doubles with each death in a row, and its report and
   the metrics say so, for `status` (pipeline/process/restart_policy.py).
5. On SIGTERM or SIGINT (handlers only set a flag): stop the stages front
   first, so work already accepted drains downstream; each gets
   `stop_timeout_s` before SIGKILL. Say how many items are left queued; exit 0.

Its own report, `<data_dir>/supervisor.json` (pipeline/process/supervisor_report.py),
says at every change which process runs each stage, whether it is up, and
its deaths and restarts: programs and tests read that, never its log.

The supervisor sits on the ground floor and names no upper floor: the stage
classes (in `StageSpec`) and the housekeeping of upper floors (`Housekeeping`)
are handed to it by the composition root (assembly/broker.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections import deque
from typing import Any

from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError, FabricError
from pipeline.process import announce
from pipeline.process.fork_server import start_forked
from pipeline.process.heartbeat import Heartbeat
from pipeline.process.housekeeping import Housekeeping
from pipeline.process.logs import setup_stage_logging
from pipeline.process.preflight import preflight
from pipeline.process.restart_policy import plan_restart
from pipeline.process.signal_wake import SignalWake
from pipeline.process.stage import DISK_FULL_EXIT, StageSpec, stage_main
from pipeline.process.stage_child import StageChild, describe_exit
from pipeline.process.stage_restarts import last_error_line, log_size
from pipeline.process.supervisor_report import (
    MAX_DEATHS,
    REPORT_FILE,
    left_from_last_life,
    write_report,
)
from pipeline.store.datadir import DataDir
from pipeline.store.recovery import recover
from pipeline.telemetry.health import Health
from pipeline.telemetry.metrics_hub import MetricsHub
from pipeline.telemetry.metrics_server import MetricsServer
from pipeline.transport.ring import Ring
from pipeline.transport.security import (
    ServerKeys,
    check_exposure,
    loose_authorized_keys,
    loose_permissions,
)
from pipeline.transport.topology import RING_BYTES, RingSpec, remove_run_dir

log = logging.getLogger("fabric.supervisor")
PRELOADED = {
    "numpy",
    "zmq",
    "orjson",
    "pipeline.process.stage",
    "config",
}  # besides the stage modules
STARTING_POLL_S = 0.02  # while a stage starts, how often its ready event is looked at
IDLE_WAIT_S = 1.0  # the longest wait with nothing due: a stage's exit or a signal wakes it at once
LAST_LIFE_WAIT_S = 10.0  # the longest wait at start for the stages of a broker life just killed


def _fresh_ring(ring: RingSpec) -> None:
    """Create (or replace) a ring; the stages at both ends attach by name."""
    Ring.create(ring.name, RING_BYTES).close()


class Supervisor:
    """Owns the stage processes of one broker."""

    def __init__(
        self,
        settings,
        specs: list[StageSpec],
        rings: list[RingSpec] | None = None,
        housekeeping: Housekeeping | None = None,
    ) -> None:
        self.settings = settings
        self.rings = rings or []
        self.config = settings.supervisor
        self.data_dir = DataDir(settings.data_path)
        self.housekeeping = housekeeping or Housekeeping()
        self.collector = self.housekeeping.collector
        self._children = [StageChild(spec) for spec in specs]
        # Stage processes come from a fork server that imported the stage modules once (a
        # fresh interpreter each, as with spawn, costs about 0.5 s of CPU per stage start).
        self._context = multiprocessing.get_context("forkserver")
        self._preload = sorted(PRELOADED | {child.spec.module for child in self._children})
        self._context.set_forkserver_preload(self._preload)
        self._stop = False
        self.failure: str | None = None
        self.next_sweep = 0.0
        self.heartbeat: Heartbeat | None = None
        self.metrics_hub = MetricsHub()  # what the stages report, restarts; served by `metrics`
        self.metrics: MetricsServer | None = None
        self.health = Health()  # /live and /ready on metrics.bind (pipeline/telemetry/health.py)
        self.said_ready = False
        self.said_failures: set[str] = set()  # start failures already printed
        self.epoch = 0
        self.running = False
        self.deaths: deque[dict[str, Any]] = deque(maxlen=MAX_DEATHS)

    # ---- lifecycle -------------------------------------------------------
    def _after_recovery(self, report) -> None:
        """Isolate damaged input segments and account for lost items (pipeline/store/salvage.py,
        collector/losses.py); a failure here is logged and the broker serves what it can."""
        step = self.housekeeping.after_recovery
        if step is None:
            return
        try:
            lost = step(self.data_dir, report.damaged, report.torn())
        except (FabricError, OSError) as exc:
            log.error("isolating damage after recovery failed: %s; serving what is readable", exc)
            return
        for job in lost:
            log.error("%s; recorded as corrupt_input error results", job.line())

    def _outlive_last_life(self) -> None:
        """Wait (up to LAST_LIFE_WAIT_S) for the stages of a broker life killed a moment ago:
        they die with it, but not at once, and until then they hold its ports."""
        deadline = time.monotonic() + LAST_LIFE_WAIT_S
        while left := left_from_last_life(self.data_dir.root):
            if time.monotonic() >= deadline:
                log.warning("stages of the last broker life still run (pids %s)", left)
                return
            time.sleep(0.05)

    def start(self) -> None:
        """Lock, recover, collect, and start every stage.

        Raises ConfigError (an exposed bind, a bad key) before anything is
        touched, and DataDirLockedError.
        """
        security = self.settings.security
        insecure = check_exposure(self.settings)
        ServerKeys.load(security)  # a bad key file stops the start here, not in every stage
        os.umask(0o077)  # inherited by every stage: data dir files are the owner's alone
        self.epoch = time.time_ns()  # passed to every stage it starts (front, dispatch files)
        # The fork server the stages come from: a fork of this process, made while it is one
        # thread and holds nothing open (pipeline/process/fork_server.py); it imports the stage
        # modules while this process recovers.
        start_forked(self._preload)
        self.data_dir.lock()
        self._outlive_last_life()
        try:  # what would stop a stage at start: files named in the config, ports in use
            preflight(self.settings, self.housekeeping.check_files)
        except ConfigError:
            self.data_dir.unlock()
            raise
        with contextlib.suppress(OSError):  # a data dir made before (or by someone else)
            os.chmod(self.data_dir.root, 0o700)
        setup_stage_logging(self.data_dir.log, "supervisor-0")
        for line in insecure + loose_authorized_keys(security):
            log.warning("%s", line)
            print(f"fabric: WARNING: {line}", file=sys.stderr, flush=True)
        if security.curve and (mode := loose_permissions(security.server_key)) is not None:
            log.warning(
                "security.server_key %s is readable by group or others (mode %o); chmod 600 it",
                security.server_key,
                mode,
            )
        multiprocessing.forkserver.ensure_running()  # started afresh if the fork died
        self.running = True
        self._write_report()  # what an earlier broker life reported is stale
        self.heartbeat = Heartbeat(self.settings.dispatch.heartbeat_bind, self.epoch, security)
        self.heartbeat.start()
        self.metrics = MetricsServer(self.settings, self.metrics_hub, self.health)
        self.metrics.start()
        report = recover(self.data_dir, self.settings.broker.recovery_processes)
        log.info(
            "recovery: %d segments, %d live items, %d torn slots cut, %d damaged files, %.3f s",
            len(report.segments),
            report.live,
            report.torn(),
            len(report.damaged),
            report.elapsed_s,
        )
        if report.damaged or report.torn() or self.data_dir.losses_owed.exists():
            self._after_recovery(report)  # owed: an earlier start moved damage aside, then died
        # Input segments go at once; completion segments wait for their job's retention (sweep).
        if self.collector is not None:
            self.collector.offer(
                [s for s in report.finished if s.path.parent == self.data_dir.segments]
            )
        self.heartbeat.recovered = True
        for ring in self.rings:
            _fresh_ring(ring)
        now = time.monotonic()
        for child in self._children:
            self._spawn(child, now)
        self._write_report()
        for line in announce.start_lines(self.settings):
            announce.say(line)

    def request_stop(self, *_: object) -> None:
        """Signal handler: only sets the flag."""
        self._stop = True

    def run(self) -> int:
        """Start, supervise until SIGTERM or a crash loop, stop; returns the exit code."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.start()
        wake = SignalWake()  # after recovery, whose forked scanners would inherit it
        try:
            while not self._stop and self.failure is None:
                now = time.monotonic()
                self.step(now)
                self._wait(self._wait_s(now), wake)
        finally:
            wake.close()
            self.stop()
            self.data_dir.unlock()
        if self.failure is not None:
            print(f"fabric: stopping: {self.failure}", file=sys.stderr, flush=True)
            return exitcodes.STAGE_FAILED
        log.info("broker stopped cleanly")
        announce.say(
            f"drained, {announce.left_queued(self.data_dir.segments):,} items left queued, stopped"
        )
        return exitcodes.OK

    def _starting(self) -> bool:
        """A stage process runs that has not yet set its ready event."""
        return any(c.process is not None and not c.up for c in self._children)

    def _wait_s(self, now: float) -> float:
        """How long the loop may sleep: until a restart, a collector retry or a sweep is due
        (at most IDLE_WAIT_S), or STARTING_POLL_S while a stage starts (its ready event is
        looked at, not waited on). A stage's exit and a signal end the wait sooner."""
        if self._starting():
            return STARTING_POLL_S
        due = [now + IDLE_WAIT_S]
        due += [c.restart_at for c in self._children if c.restart_at is not None]
        if self.collector is not None:
            due.append(self.next_sweep)
            if (retry := self.collector.next_step_s()) is not None:
                due.append(retry)
        return min(IDLE_WAIT_S, max(0.0, min(due) - now))

    def _wait(self, timeout_s: float, wake: SignalWake) -> None:
        """Wait until a child exits, a signal arrives or `timeout_s` passes (no busy loop)."""
        sentinels = [c.process.sentinel for c in self._children if c.process is not None]
        if wake.fd is not None:
            sentinels.append(wake.fd)
        if wake.fd in multiprocessing.connection.wait(sentinels, timeout=timeout_s):
            wake.drain()

    # ---- one step ----------------------------------------------------------
    def step(self, now: float) -> None:
        """Notice dead stages, restart those whose backoff has passed, run the collector."""
        changed = False
        for child in self._children:
            process = child.process
            if process is not None and process.exitcode is not None:
                self._on_death(child, now)
                changed = True
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                self._spawn(child, now)
                log.info("restarted stage %s (pid %d)", child.spec.label, child.process.pid)
                changed = True
            if child.process is not None and not child.up and child.ready.is_set():
                child.up = True
                child.release_ready()
                changed = True
        self._say_ready()
        self.health.turned(c.spec.label for c in self._children if c.spec.critical and not c.up)
        if changed:
            self._write_report()
        if self.collector is None:
            return
        self.collector.step(now)
        if now >= self.next_sweep:
            self.next_sweep = now + self.settings.collector.interval_s
            self.collector.sweep(self.data_dir, self.settings.completion.results_retention_s)

    def _say_ready(self) -> None:
        """Print "ready" once every stage that is running or restarting has come up."""
        if self.said_ready:
            return
        waiting = [c for c in self._children if c.process is not None or c.restart_at is not None]
        if all(c.up for c in waiting):
            self.said_ready = True
            log.info("every stage is up")
            announce.say("ready")

    def _say_start_failure(self, child: StageChild, how: str) -> None:
        """A stage that died before it was up: its last error line, on the terminal, once."""
        if child.ready is None or child.ready.is_set():
            return
        path = self.data_dir.log / f"{child.spec.label}.log"
        line = child.last_error or f"no error in {path}"
        if line not in self.said_failures:
            self.said_failures.add(line)
            announce.say(f"stage {child.spec.label} died at start ({how}): {line}")

    def _on_death(self, child: StageChild, now: float) -> None:
        how = describe_exit(child.process.exitcode)
        child.last_error = last_error_line(
            self.data_dir.log / f"{child.spec.label}.log", child.log_offset
        )
        self._say_start_failure(child, how)
        child.release_ready()
        disk_full = child.process.exitcode == DISK_FULL_EXIT
        child.process.close()
        child.process = None
        child.up = False
        self.metrics_hub.ended(child.spec.label)
        child.total_deaths += 1
        child.last_exit = how
        death = {"at_ns": time.time_ns(), "stage": child.spec.label, "how": how}
        self.deaths.append(death)
        log_path = self.data_dir.log / f"{child.spec.label}.log"
        if failure := plan_restart(child, now, how, disk_full, self.config, log_path):
            self.failure = failure  # a critical stage's crash loop: the broker stops
        restart_at = child.restart_at
        death["restart_in_s"] = None if restart_at is None else round(restart_at - now, 3)
        if restart_at is None or disk_full:
            return
        if not child.spec.critical:  # restarted forever: the metrics say it waits
            self.metrics_hub.waiting(child.spec.label, restart_at, child.in_a_row)
            return
        for ring in self.rings:  # whatever it held is dropped; chunks are retried
            if child.spec.label in (ring.src, ring.dst):
                _fresh_ring(ring)

    def _write_report(self) -> None:
        """Replace `<data_dir>/supervisor.json` (pipeline/process/supervisor_report.py) with the
        state of every stage now."""
        now, now_ns = time.monotonic(), time.time_ns()
        stages = [c.report_entry(now, now_ns, self.running) for c in self._children]
        report = {
            "pid": os.getpid(),
            "epoch": self.epoch,
            "running": self.running,
            "ready": self.said_ready,
            "stages": stages,
            "deaths": list(self.deaths),
        }
        try:
            write_report(self.data_dir.root, report)
        except OSError as exc:  # a full disk: the log lines still say it
            log.warning("cannot write %s: %s", REPORT_FILE, exc)

    def _spawn(self, child: StageChild, now: float) -> None:
        child.ready = self._context.Event()
        child.log_offset = log_size(self.data_dir.log / f"{child.spec.label}.log")
        process = self._context.Process(
            target=stage_main,
            args=(child.spec, self.epoch, os.getpid(), child.ready),
            name=child.spec.label,
        )
        process.start()
        child.process = process
        child.starts += 1
        child.up = False
        self.metrics_hub.started(child.spec.label, process.pid)
        child.restart_at = None
        child.started_at = now
        log.info("started stage %s (pid %d)", child.spec.label, process.pid)
        if child.total_deaths and not child.spec.critical:
            self.metrics_hub.waiting(child.spec.label, None, child.in_a_row)

    # ---- stopping ------------------------------------------------------------
    def stop(self) -> None:
        """Stop stages front first; SIGKILL any that outlive `stop_timeout_s`."""
        self.health.stopping()
        for child in self._children:
            process = child.process
            if process is None:
                continue
            if process.exitcode is None:
                process.terminate()
                process.join(self.config.stop_timeout_s)
            if process.exitcode is None:
                log.error(
                    "stage %s did not stop in %.0f s; killing it",
                    child.spec.label,
                    self.config.stop_timeout_s,
                )
                process.kill()
                process.join(5)
            child.last_exit = describe_exit(process.exitcode)
            log.info("stage %s stopped (%s)", child.spec.label, child.last_exit)
            process.close()
            child.process = None
            child.up = False
            child.release_ready()
            self.metrics_hub.ended(child.spec.label)
        if self.running:
            self.running = False
            self._write_report()
        for ring in self.rings:
            Ring.unlink(ring.name)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.metrics is not None:
            self.metrics.stop()
        remove_run_dir(self.settings)  # every process that bound an ipc socket has stopped

    def pids(self) -> dict[str, int]:
        return {c.spec.label: c.process.pid for c in self._children if c.process is not None}
