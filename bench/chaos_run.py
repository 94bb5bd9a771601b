"""The chaos run itself: a broker, its workers and clients, and the faults done to them.

`Chaos.run` starts a broker (bench/chaos_fleet.py), two remote workers and a lying one,
keeps `jobs` jobs going (each submitted and fetched by `run.py` clients, run again when
they fail), and every 0.2-1.5 s does one fault: SIGKILL a stage, a remote worker, the
whole broker (then maybe damages an input segment), a results client or a submit,
SIGSTOPs a worker past its lease, or with power cuts (bench/chaos_power.py) cuts the
power of the broker's machine or of the results clients'. Then it stops the faults and
lets every job finish; bench/chaos_verify.py checks each one and the data dir.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from bench.chaos_fleet import (
    ECHO_FAULTS,
    LEASE_S,
    REPO,
    BrokerProcess,
    Client,
    Job,
    run_py,
    write_config,
    write_job,
)
from bench.chaos_power import BROKER_CUT, CLIENT_CUT, PowerCuts
from bench.chaos_report import Report
from bench.chaos_verify import Verdict
from gpu.worker.options import WorkerOptions

LYING_WORKER = REPO / "tests" / "procs" / "lying_worker.py"
DAMAGE_CHANCE = 0.5  # of a whole-broker kill: one input segment is damaged before the restart
POWER_CUT_CHANCE = 0.3  # --power-cuts: of the actions, a power cut (the rest as without)
CLIENT_CUT_SHARE = 0.2  # of the power cuts: of the results clients' disk
STAGES = ("front", "tokenizer", "router", "writer", "dispatch", "completion", "vectors", "worker")


class Chaos:
    def __init__(
        self,
        root: Path,
        seed: int,
        items: int,
        jobs: int,
        local_workers: int = 2,
        damage: float = DAMAGE_CHANCE,
        broker_kill_by_s: float | None = None,
        power: PowerCuts | None = None,
    ) -> None:
        """`broker_kill_by_s`: if no action killed the whole broker this many seconds into
        the run, the next action does once an input segment exists (a short run then always
        has one, with a segment to damage)."""
        self.root = root
        self.power = power
        self.out_dir = root if power is None else power.out_dir
        self.broker_kill_by_s = broker_kill_by_s
        self.began = time.monotonic()
        self.random = random.Random(seed)
        self.rng = np.random.default_rng(seed)
        self.items, self.jobs_in_flight = items, jobs
        self.env = dict(os.environ)
        self.config = write_config(root, local_workers)
        # front, tokenizer, router, writer, dispatch, completion, vectors, and the local workers
        self.broker = BrokerProcess(self.config, root / "data", self.env, 7 + local_workers)
        self.workers = [  # remote workers: one for each model (the local ones serve echo)
            Client(
                f"remote {model} worker",
                run_py(
                    "worker",
                    *WorkerOptions(
                        broker=_address(self.config, "dispatch", "bind"),
                        model=model,
                        heartbeat=_address(self.config, "dispatch", "heartbeat_bind"),
                        engine="echo",
                        batch_items=64,
                        drain_s=5,
                        target_batch_s=0,
                        engine_options=ECHO_FAULTS,
                    ).argv(),
                ),
                self.env,
                root / f"worker-{model}.log",
            )
            for model in ("echo", "texty")
        ]
        # a lying worker: the real worker whose RESULTS are damaged per item (wrong size,
        # wrong kind, bad status, NaN, wrong dimension); completion refuses them
        self.liar = Client(
            "lying echo worker",
            [
                sys.executable,
                str(LYING_WORKER),
                *run_py(
                    "worker",
                    *WorkerOptions(
                        broker=_address(self.config, "dispatch", "bind"),
                        model="echo",
                        heartbeat=_address(self.config, "dispatch", "heartbeat_bind"),
                        engine="echo",
                        batch_items=16,
                        target_batch_s=0,
                        engine_options=ECHO_FAULTS,
                    ).argv(),
                )[2:],
            ],
            self.env,
            root / "worker-liar.log",
        )
        self.workers.append(self.liar)
        self.damage_chance = damage
        self.jobs: list[Job] = []
        self.finished: list[Job] = []
        self.stopped: dict[int, float] = {}  # pid -> when to SIGCONT it
        self.settling_since: float | None = None  # when the kills stopped
        self.report = Report()
        self.verdict = Verdict(self.config, root / "data", self.report)
        self.next_job = 0

    # ---- the run ---------------------------------------------------------------------
    def run(self, seconds: float, progress=None) -> Report:
        began = time.monotonic()
        self.broker.start()
        for worker in self.workers:
            worker.start()
        self.began = time.monotonic()  # the chaos starts: the first start is not counted
        deadline = self.began + seconds
        next_action = time.monotonic() + 1.0
        next_note = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                self._tend()
                now = time.monotonic()
                if now >= next_action:
                    self._act()
                    next_action = time.monotonic() + self.random.uniform(0.2, 1.5)
                if progress is not None and now >= next_note:
                    next_note = now + 30
                    progress(self.report, now - began, len(self.finished))
                time.sleep(0.05)
            self._settle()
        finally:
            for job in self.jobs + self.finished:
                job.submit.stop()
                if job.fetch is not None:
                    job.fetch.stop()
            for worker in self.workers:
                worker.done = True
                worker.stop()
            self._resume_all()
            if self.broker.proc is not None and self.broker.proc.poll() is None:
                code = self.broker.stop()
                if code != 0:
                    self.report.problems.append(f"the broker exited with {code} on SIGTERM")
        self.verdict.check_data_dir(self.broker)
        self.report.liar_runs = self.liar.runs
        self.report.seconds = time.monotonic() - began
        return self.report

    def _tend(self) -> None:
        """Keep jobs going, re-run failed clients, resume stopped workers, restart a dead broker."""
        if self.broker.proc.poll() is not None:
            self.report.problems.append(
                f"the broker exited by itself with {self.broker.proc.returncode}; restarted"
            )
            self.broker.start()
        for worker in self.workers:
            code = worker.proc.poll()
            if code is not None:
                if code == -signal.SIGKILL:
                    self.report.poison_deaths += 1  # the poison item killed it
                worker.start()
        for pid, when in list(self.stopped.items()):
            if time.monotonic() >= when:
                _signal(pid, signal.SIGCONT)
                del self.stopped[pid]
        while len(self.jobs) < self.jobs_in_flight:
            self._new_job()
        for job in list(self.jobs):
            job.submit.poll()
            if job.submit.done and job.fetch is None:
                job.fetch = Client(
                    f"results {job.spec.job_id}",
                    run_py(
                        "results",
                        job.spec.job_id,
                        "-o",
                        str(job.out),
                        "--errors",
                        str(job.err),
                        "--follow",
                        "--config",
                        str(self.config),
                    ),
                    self.env,
                    self.root / f"{job.spec.job_id}.results.log",
                )
                job.fetch.start()
            if job.fetch is not None:
                job.fetch.poll()
                if job.fetch.done:  # verified at once, while completion still holds its counters
                    if self.settling_since is not None:
                        waited = time.monotonic() - self.settling_since
                        self.report.settle_s = max(self.report.settle_s, waited)
                    self.jobs.remove(job)
                    self.finished.append(job)
                    self.verdict.verify(job)

    def _new_job(self) -> None:
        job_id = f"chaos-{self.next_job:04d}"
        self.next_job += 1
        spec = write_job(self.root, job_id, self.items, self.rng)
        submit = Client(
            f"submit {job_id}",
            run_py(
                "submit",
                str(spec.path),
                "--job-id",
                job_id,
                "--config",
                str(self.config),
                "--errors",
                str(self.root / f"{job_id}.rejected.jsonl"),
            ),
            self.env,
            self.root / f"{job_id}.submit.log",
        )
        out, err = self.out_dir / f"{job_id}.out.jsonl", self.out_dir / f"{job_id}.err.jsonl"
        job = Job(spec, submit, None, out, err)
        submit.start()
        self.jobs.append(job)

    def _act(self) -> None:
        roll = self.random.random()
        kills = self.report.kills
        overdue = self.broker_kill_by_s is not None and not kills["whole broker"]
        overdue = overdue and time.monotonic() >= self.began + self.broker_kill_by_s
        if overdue and any((self.root / "data" / "segments").glob("in-*.seg")):  # one to damage
            roll = 0.7  # a whole-broker kill
        if self.power is not None and self.random.random() < POWER_CUT_CHANCE:
            self._power_cut()
        elif roll < 0.55:
            pids = {
                label: pid
                for label, pid in self.broker.pids().items()
                if label.split("-")[0] in STAGES
            }
            label = self.random.choice(sorted(pids))
            if _signal(pids[label], signal.SIGKILL):
                kills[f"stage {label.rsplit('-', 1)[0]}"] += 1
        elif roll < 0.65:
            worker = self.random.choice(self.workers)
            if worker.kill():
                kills["remote worker"] += 1
                worker.start()
        elif roll < 0.72:
            self.broker.kill()
            # Its local workers died with it; a stopped remote worker did not, and must still
            # be resumed (forgetting it left the one worker of a model stopped for good).
            remote = {w.proc.pid for w in self.workers if w.proc is not None}
            self.stopped = {pid: when for pid, when in self.stopped.items() if pid in remote}
            kills["whole broker"] += 1
            if self.random.random() < self.damage_chance:
                self._damage_a_segment()
            self.broker.start()
        elif roll < 0.85:
            fetching = [j.fetch for j in self.jobs if j.fetch is not None]
            if fetching and self.random.choice(fetching).kill():
                kills["results client"] += 1
        elif roll < 0.95:
            submitting = [j.submit for j in self.jobs if not j.submit.done]
            if submitting and self.random.choice(submitting).kill():
                kills["submit client"] += 1
        else:
            pids = [pid for label, pid in self.broker.pids().items() if label.startswith("worker")]
            pids += [w.proc.pid for w in self.workers if w.proc.poll() is None]
            pids = [p for p in pids if p not in self.stopped]
            if pids:
                pid = self.random.choice(pids)
                if _signal(pid, signal.SIGSTOP):
                    self.stopped[pid] = time.monotonic() + LEASE_S + self.random.uniform(1, 4)
                    kills["SIGSTOP worker"] += 1

    def _power_cut(self) -> None:
        """The power goes: of the broker's machine (its stages and what it never fsynced
        go; a stopped remote worker lives on, as after a kill) or, less often, of the
        results clients' (they are run again by `_tend`)."""
        if self.random.random() < CLIENT_CUT_SHARE:
            # every results client runs on that machine, whether or not it has a file open
            fetching = [j.fetch.proc.pid for j in self.jobs if j.fetch and j.fetch.proc]
            self.power.cut_client(fetching)
            self.report.power_cuts[CLIENT_CUT] += 1
            return
        self.power.cut_broker(self.broker.proc.pid)
        self.broker.proc.wait(timeout=30)
        remote = {w.proc.pid for w in self.workers if w.proc is not None}
        self.stopped = {pid: when for pid, when in self.stopped.items() if pid in remote}
        self.report.power_cuts[BROKER_CUT] += 1
        self.broker.start()

    def _damage_a_segment(self) -> None:
        """With the broker down, damage one input segment as a disk might: cut it mid-slot
        (the items past the cut are lost: they must end as `corrupt_input` error lines) or
        flip a byte of its checksummed header (nothing is lost: the file's name and size
        vouch for the layout). The broker must isolate it and serve the rest."""
        segments = sorted((self.root / "data" / "segments").glob("in-*.seg"))
        if not segments:
            return
        path = self.random.choice(segments)
        size = path.stat().st_size
        if self.random.random() < 0.5 and size > 3 * 4096:
            cut = self.random.randrange(2 * 4096, size - 1)
            cut -= cut % 8 == 0  # never on a word boundary: mid-slot
            with open(path, "r+b") as f:  # durable, as damage on a disk is
                os.ftruncate(f.fileno(), cut)
                os.fsync(f.fileno())
            self.report.damage["input segment cut mid-slot"] += 1
        else:
            with open(path, "r+b") as f:
                f.seek(40)  # created_ns: inside the header's CRC, outside the layout fields
                byte = f.read(1)
                f.seek(40)
                f.write(bytes([byte[0] ^ 0x5A]))
                f.flush()
                os.fsync(f.fileno())
            self.report.damage["input segment header byte flipped"] += 1

    def _resume_all(self) -> None:
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)
        self.stopped.clear()

    # ---- the end ---------------------------------------------------------------------
    def _settle(self, timeout_s: float = 600.0) -> None:
        """No more kills or new jobs: let every job in flight finish and be fetched."""
        self._resume_all()
        self.jobs_in_flight = 0
        self.settling_since = time.monotonic()
        deadline = self.settling_since + timeout_s
        while self.jobs and time.monotonic() < deadline:
            self._tend()
            time.sleep(0.1)
        if self.jobs:
            self.report.settle_s = time.monotonic() - self.settling_since
            stuck = self.verdict.stuck_work()
        for job in self.jobs:
            self.report.problems.append(
                f"job {job.spec.job_id} did not finish within {timeout_s:.0f} s "
                f"after the kills stopped ({self.verdict.job_counts(job)}); {stuck}"
            )


def _address(config: Path, section: str, key: str) -> str:
    import tomllib

    return tomllib.loads(config.read_text())[section][key]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
