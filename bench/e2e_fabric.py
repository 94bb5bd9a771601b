"""Step 1 of bench/e2e.py: submit to delivered, through one broker with local echo workers.

Per run, a fresh broker (`[workers] local = W`, engine echo) and one job of
N pre-tokenised items: this process submits them with the producer SDK;
as soon as the first chunk is acknowledged, `python run.py results JOB -o
OUT --errors ERR --follow --config F` starts (a `ResultsClient.fetch(...,
follow=True)`: every page written and fsynced before it is acknowledged)
and runs until the job is finished and every result delivered. Timed from
the first SDK call until that process exits. Then every broker process's
memory is read (pids from the supervisor's log), the output is counted,
and the broker is stopped with SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import ingest_profile
from bench.dispatch_common import MODEL, memory, submit
from bench.ingest_broker import REPO, BenchBroker, cpu_times

RESULTS_TIMEOUT_S = 300.0
PROFILE_S = 6
PROFILED = ("dispatch-0", "completion-0", "worker-0", "front-0", "writer-0")


@dataclass(frozen=True)
class Setup:
    workers: int
    batch_items: int
    session_max_batches: int

    @property
    def label(self) -> str:
        k = "worker" if self.workers == 1 else "workers"
        return (
            f"{self.workers} local echo {k}, batch {self.batch_items}, "
            f"max {self.session_max_batches} batches/session"
        )


@dataclass
class Run:
    items: int
    seconds: float  # first SDK call -> results client exited
    submit_s: float  # first SDK call -> submit returned (every item durable)
    first_result_s: float  # first SDK call -> results client started (first chunk acked)
    lines: int
    error_lines: int
    rss: dict[str, dict[str, int]] = field(default_factory=dict)  # process -> memory()
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the run
    profile: list = field(default_factory=list)  # ingest_profile.Profile per process
    refetch_s: float | None = None  # `run.py results JOB --all` of the finished job, seconds
    exit_code: int | None = None  # the broker's, after SIGTERM
    log_problems: list[str] = field(default_factory=list)  # WARNING / ERROR lines of its stages

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def broker_for(root: Path, setup: Setup) -> BenchBroker:
    return BenchBroker(
        root,
        [MODEL],
        sections={
            "dispatch": {"session_max_batches": setup.session_max_batches},
            "workers": {
                "local": setup.workers,
                "engine": "echo",
                "batch_items": setup.batch_items,
                "batch_tokens": setup.batch_items * 512,
            },
        },
    )


def run_once(
    root: Path, setup: Setup, rows: np.ndarray, profile: bool = False, refetch: bool = False
) -> Run:
    """One timed run on a fresh broker; with `refetch`, then the finished job's results once
    more (`run.py results JOB --all`), timed alone: delivery without anything else running."""
    broker = broker_for(root, setup)
    job = f"e2e-{os.getpid()}"
    try:
        broker.start()
        run = _timed(broker, rows, job, profile)
        if refetch:
            run.refetch_s = _refetch(broker, job, rows.shape[0])
        run.exit_code = broker.stop()
        run.log_problems = broker.stage_log_problems()
    finally:
        broker.close()
    return run


def _timed(broker: BenchBroker, rows: np.ndarray, job: str, profile: bool) -> Run:
    n = rows.shape[0]
    out, err = broker.root / "out.jsonl", broker.root / "err.jsonl"
    client: dict = {}
    spies = Spies(broker.root / "profile") if profile else None
    log = open(broker.root / "results.log", "w")  # noqa: SIM115 - closed below

    def start_client(report, lines_done: int) -> None:
        if "proc" in client or report.stored == 0:
            return
        client["at"] = time.perf_counter()
        client["proc"] = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "run.py"),
                "results",
                job,
                "-o",
                str(out),
                "--errors",
                str(err),
                "--follow",
                "--config",
                str(broker.config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        if spies is not None:
            spies.start("results client (run.py results)", client["proc"].pid)

    if spies is not None:
        for label, pid in broker.pids().items():
            if label in PROFILED:
                spies.start(label, pid)
    watched = {"supervisor": broker.proc.pid, **broker.pids(), "producer (bench)": os.getpid()}
    cpu0 = {label: sum(cpu_times(pid)) for label, pid in watched.items()}
    started = time.perf_counter()
    try:
        submit_s = submit(broker, job, rows, progress=start_client)
        proc = client["proc"]
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        while True:  # wait4, not poll: the client's own CPU time comes with its exit status
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the results client did not finish in {RESULTS_TIMEOUT_S} s")
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        cpu = {label: sum(cpu_times(pid)) - cpu0[label] for label, pid in watched.items()}
        cpu["results client"] = usage.ru_utime + usage.ru_stime
    finally:
        if "proc" in client and client["proc"].poll() is None:
            client["proc"].kill()
        log.close()
    if proc.returncode != 0:
        tail = (broker.root / "results.log").read_text()[-1000:]
        raise RuntimeError(f"run.py results exited with {proc.returncode}: {tail}")
    rss = broker_memory(broker)
    run = Run(n, seconds, submit_s, client["at"] - started, _count_lines(out), _count_lines(err))
    run.rss, run.cpu = rss, cpu
    if spies is not None:
        run.profile = spies.finish()
    if run.lines != n or run.error_lines:
        raise RuntimeError(f"{out}: {run.lines:,} lines for {n:,} items, {run.error_lines} errors")
    return run


class Spies:
    """One `py-spy record` per process, each for PROFILE_S from when it is started."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.binary = ingest_profile.py_spy()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, label: str, pid: int) -> None:
        if self.binary is None:
            return
        self.procs[label] = subprocess.Popen(
            [
                self.binary,
                "record",
                "-d",
                str(PROFILE_S),
                "-r",
                str(ingest_profile.RATE),
                "-f",
                "raw",
                "-o",
                str(self.out_dir / f"{label.split()[0]}.txt"),
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def finish(self) -> list:
        profiles = []
        for label, spy in self.procs.items():
            spy.wait(timeout=PROFILE_S + 30)
            path = self.out_dir / f"{label.split()[0]}.txt"
            if spy.returncode == 0 and path.exists():
                profiles.append(ingest_profile.read_raw(path, label, PROFILE_S))
        return profiles


def _refetch(broker: BenchBroker, job: str, n: int) -> float:
    out, err = broker.root / "again.jsonl", broker.root / "again.err.jsonl"
    command = [sys.executable, str(REPO / "run.py"), "results", job, "-o", str(out), "--all"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--errors", str(err), "--config", str(broker.config)],
        capture_output=True,
        text=True,
        timeout=RESULTS_TIMEOUT_S,
        cwd=REPO,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0 or _count_lines(out) != n:
        raise RuntimeError(f"results --all: exit {done.returncode}, {done.stderr[-500:]}")
    out.unlink()
    return seconds


def broker_memory(broker: BenchBroker) -> dict[str, dict[str, int]]:
    """memory() of the supervisor and of every stage (latest pid of each, from its log)."""
    found = {"supervisor": memory(broker.proc.pid)}
    for label, pid in sorted(broker.pids().items()):
        found[label] = memory(pid)
    return found


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    count = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            count += chunk.count(b"\n")
    return count
