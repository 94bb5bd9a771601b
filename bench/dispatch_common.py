"""What the steps of bench/dispatch.py and bench/e2e.py share: workload, broker status, workers.

The workload is pre-tokenised items for the `echo` model on `/v1/completions`
with `max_tokens = 16` (a short generation after a long prompt: the results
are small, so the numbers are about moving work, not about result bytes).
`Status` asks a running broker what it holds, the way `python run.py status
--json` does (the same client classes, kept open between polls, so polling
costs no interpreter start-up). `Workers` starts `python run.py worker`
processes against a broker and stops them with SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.ingest_broker import REPO, BenchBroker, Model
from collector.results_client import DispatchClient, ResultsClient
from gpu.worker.options import WorkerOptions
from ingest.submit_client import Producer

MODEL = Model("echo", endpoints=("/v1/completions",))
ENDPOINT = "/v1/completions"
MAX_TOKENS = 16  # echo returns the first 16 prompt tokens
CHUNK_ITEMS = 4096
WINDOW = 8
SEED = 20240611
WORKER_STOP_S = 60.0


def make_rows(n: int, tokens: int, seed: int = SEED) -> np.ndarray:
    """n items of `tokens` random token ids below 30,000, as one [n, tokens] uint32 array."""
    return np.random.default_rng(seed).integers(1, 30_000, (n, tokens), dtype=np.uint32)


def submit(broker: BenchBroker, job: str, rows: np.ndarray, progress=None) -> float:
    """Submit `rows` as job `job`; seconds until every item was durable and acknowledged."""
    started = time.perf_counter()
    with Producer(broker.address, window=WINDOW) as producer:
        report = producer.submit_tokens(
            job,
            MODEL.name,
            rows,
            endpoint=ENDPOINT,
            max_tokens=MAX_TOKENS,
            chunk_lines=CHUNK_ITEMS,
            progress=progress,
        )
    seconds = time.perf_counter() - started
    if report.stored != rows.shape[0] or report.rejected:
        raise RuntimeError(
            f"job {job}: stored {report.stored:,} of {rows.shape[0]:,} ({report.rejected} "
            f"rejected): {report.errors[:3]}"
        )
    return seconds


class Status:
    """`run.py status --json` (dispatch) and `run.py status JOB --json` (completion), in-process."""

    def __init__(self, broker: BenchBroker) -> None:
        settings = broker.settings
        self.dispatch_client = DispatchClient(settings.dispatch.bind, timeout_s=10.0)
        self.results_client = ResultsClient(settings.completion.bind, timeout_s=10.0)

    def dispatch(self) -> dict:
        return self.dispatch_client.broker_status()

    def queued(self) -> int:
        """Items dispatch knows of and has not handed out (all models)."""
        return sum(int(q["queued"]) for q in self.dispatch()["queues"])

    def job(self, job: str) -> dict:
        return self.results_client.job_status(job)

    def finished(self, job: str) -> int:
        """Items of `job` with a durable result (completed or failed)."""
        info = self.job(job)
        return int(info["completed"]) + int(info["failed"])

    def close(self) -> None:
        self.dispatch_client.close()
        self.results_client.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of one process, in bytes ({} if gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return out


def pressure() -> str:
    """Linux PSI: share of the last 60 s in which some task waited for a CPU, or for I/O.

    Other work on the machine (the two cores are shared) shows here and skews timings.
    """
    parts = []
    for resource in ("cpu", "io"):
        try:
            line = Path(f"/proc/pressure/{resource}").read_text().splitlines()[0]
        except (OSError, IndexError):
            return "unknown (no /proc/pressure)"
        fields = dict(f.split("=") for f in line.split()[1:])
        parts.append(f"{resource} some avg60 {fields.get('avg60', '?')}%")
    return ", ".join(parts)


@dataclass
class Workers:
    """`python run.py worker` processes against one broker; `stop()` SIGTERMs them all."""

    broker: BenchBroker
    count: int
    engine: str = "echo"
    batch_items: int = 256
    batch_tokens: int = 262_144
    prefetch: int = 4
    options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs = []

    def start(self) -> Workers:
        settings = self.broker.settings
        for _ in range(self.count):
            log = open(self.broker.root / f"worker-{len(self.procs)}.log", "w")  # noqa: SIM115
            self.logs.append(log)
            options = WorkerOptions(
                broker=settings.dispatch.bind,
                model=MODEL.name,
                heartbeat=settings.dispatch.heartbeat_bind,
                engine=self.engine,
                batch_items=self.batch_items,
                batch_tokens=self.batch_tokens,
                prefetch=self.prefetch,
            )
            command = [sys.executable, str(REPO / "run.py"), "worker", *options.argv()]
            for option in self.options:
                command += ["--option", option]
            self.procs.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            )
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> list[int]:
        """SIGTERM every worker (they drain), wait; their exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=WORKER_STOP_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []
        return codes
