"""The processes a chaos run kills: a broker, a remote worker, submit and results clients.

Everything is started through `run.py`, as a user would, from one config
written here (`write_config`): local echo workers, one `run.py worker`
process, fast leases so a stopped or killed worker's items come back soon,
segments sealed after 2 s idle and results kept for 120 s, so that the files
of finished jobs are collected while the run goes on (but not before the
harness, which a broker start on a loaded host blocks for tens of seconds, has
verified the job: 20 s made such runs fail jobs as 'expired'), and a supervisor that
never gives up restarting a stage (a chaos run kills some stage every
second or so; the default would stop the broker after 5 restarts a minute).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.process.supervisor_report import all_up, read_report, stage_pids, still_running
from pipeline.transport.ports import free_loopback_ports

REPO = Path(__file__).resolve().parents[1]
POISON_TOKEN = 7  # an echo worker that meets an item starting with it is SIGKILLed (a bad kernel)
ECHO_FAULTS = {"poison_token": POISON_TOKEN}  # every echo worker's options (gpu/engines/echo.py)
LEASE_S = 4.0
TEXT_TOKENIZER = REPO / "gpu" / "minilm" / "tokenizer.json"


def write_config(root: Path, local_workers: int) -> Path:
    ports = free_loopback_ports(7)
    text = f"""# Written by bench/chaos_fleet.py
[broker]
data_dir = "{root / "data"}"
segment_bytes = 4194304
segment_idle_s = 2.0
[ingest]
bind = "tcp://127.0.0.1:{ports[0]}"
chunk_items = 250
chunk_timeout_s = 10.0
[dispatch]
bind = "tcp://127.0.0.1:{ports[1]}"
heartbeat_bind = "tcp://127.0.0.1:{ports[2]}"
lease_s = {LEASE_S}
session_timeout_s = 2.0
reregister_grace_s = 1.0
report_s = 0.3
max_attempts = 4
[completion]
bind = "tcp://127.0.0.1:{ports[3]}"
results_retention_s = 120.0
[vectors]
bind = "tcp://127.0.0.1:{ports[4]}"
[metrics]
bind = "127.0.0.1:{ports[5]}"
[collector]
interval_s = 1.0
[workers]
local = {local_workers}
options = {{poison_token = {POISON_TOKEN}}}
batch_items = 64
prefetch = 2
target_batch_s = 0
drain_s = 5.0
[supervisor]
restart_backoff_s = 0.2
max_restarts = 100000
stop_timeout_s = 30.0
[[models]]
name = "echo"
engine = "echo"
endpoints = ["/v1/embeddings", "/v1/completions"]
[[models]]
name = "texty"
engine = "echo"
endpoints = ["/v1/embeddings"]
tokenizer = "{TEXT_TOKENIZER}"
max_tokens = 64
"""
    path = root / "chaos.toml"
    path.write_text(text)
    return path


@dataclass
class JobInput:
    job_id: str
    path: Path
    lines: int
    poison_line: int  # 1-based
    broken_lines: frozenset[int]
    too_long_lines: frozenset[int]


def write_job(root: Path, job_id: str, n: int, rng: np.random.Generator) -> JobInput:
    """n lines: token ids for `echo` (embeddings and completions), text for `texty` (some too
    long for it), broken JSON every 97th line, and one poison item."""
    path = root / f"{job_id}.jsonl"
    poison = int(rng.integers(1, n + 1))
    broken, too_long = set(), set()
    words = ["queue", "log", "tombstone", "lane", "segment", "worker", "lease", "shard"]
    with open(path, "w") as out:
        for line in range(1, n + 1):
            if line % 97 == 0 and line != poison:
                out.write('{"custom_id": "broken", "method": "POST", \n')
                broken.add(line)
                continue
            url = "/v1/embeddings"
            if line == poison:
                body = {"model": "echo", "prompt_token_ids": [POISON_TOKEN, 11, 12]}
            elif line % 5 == 0:
                long = line % 35 == 0
                count = 120 if long else int(rng.integers(1, 40))
                body = {"model": "texty", "input": " ".join(rng.choice(words, count))}
                if long:
                    too_long.add(line)
            else:
                tokens = rng.integers(10, 30000, int(rng.integers(1, 300))).tolist()
                body = {"model": "echo", "prompt_token_ids": tokens}
                if line % 3 == 0:
                    url = "/v1/completions"
                    body["max_tokens"] = 8
            record = {"custom_id": f"{job_id}-{line}", "method": "POST", "url": url, "body": body}
            out.write(json.dumps(record) + "\n")
    return JobInput(job_id, path, n, poison, frozenset(broken), frozenset(too_long))


def run_py(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), *args]


class BrokerProcess:
    """`python run.py --config FILE`, its stage pids (from the supervisor's report), kills."""

    def __init__(self, config: Path, data_dir: Path, env: dict, stages: int) -> None:
        self.config, self.data_dir, self.env = config, data_dir, env
        self.stages = stages  # stage processes it runs, local workers included
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> None:
        self.proc = subprocess.Popen(
            run_py("--config", str(self.config)),
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a power cut kills its whole session (bench/power_cut.py)
        )
        deadline = time.monotonic() + timeout_s
        while not self.all_up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited with {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                raise RuntimeError("the broker's stages did not all come up")
            time.sleep(0.1)

    def report(self) -> dict | None:
        """The supervisor's report of this broker life (pipeline/process/supervisor_report.py)."""
        report = read_report(self.data_dir)
        if report is None or self.proc is None or report.get("pid") != self.proc.pid:
            return None
        return report

    def pids(self) -> dict[str, int]:
        return stage_pids(self.report())

    def all_up(self) -> bool:
        """Every stage of this life is up (each had opened its sockets), and each stage
        restarted since is up again."""
        report = self.report()
        return all_up(report, self.proc.pid) and len(report["stages"]) >= self.stages

    def kill(self) -> None:
        """SIGKILL the supervisor; its stages die with it (PR_SET_PDEATHSIG). Wait for all."""
        stages = list(self.pids().values())
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(still_running(pid) for pid in stages) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


class Client:
    """A client command re-run until it succeeds: a submit, a results --follow, a worker."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen | None = None
        self.runs = 0
        self.done = False

    def start(self) -> None:
        self.runs += 1
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )

    def poll(self, forever: bool = False) -> None:
        """Restart it if it ended without success (or at all, when `forever`)."""
        if self.done or self.proc is None:
            return
        code = self.proc.poll()
        if code is None:
            return
        if code == 0 and not forever:
            self.done = True
            return
        self.start()

    def kill(self) -> bool:
        if self.proc is None or self.proc.poll() is not None or self.done:
            return False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@dataclass
class Job:
    """A job of the run: its input, its submit and (once submitted) its results client, and
    the files that client writes."""

    spec: JobInput
    submit: Client
    fetch: Client | None = None
    out: Path = Path()
    err: Path = Path()
