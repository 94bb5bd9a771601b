"""Chaos: a whole broker under random kills for as long as asked, every outcome checked at the end.

    .venv/bin/python -m bench.chaos --minutes 30 [--seed 1] [--items 2000] [--jobs 2]
        [--damage P] [--power-cuts] [--root DIR] [--report-json FILE] [--quick]

(tests/test_chaos.py runs it for 45 s, with `--report-json`, and checks the report.)

It starts a broker (bench/chaos_fleet.py: 2 local echo workers), two
`run.py worker` processes (echo and texty) and a lying echo worker
(tests/procs/lying_worker.py: the real worker whose results are damaged per
item, which completion must refuse), and keeps `--jobs` jobs going: each is submitted
with `run.py submit --job-id` (token ids and text, broken lines, text too
long for its model, and one poison item that SIGKILLs any worker that runs
it) and fetched with `run.py results --follow`. Until the time is up, every
0.2-1.5 s it does one of: SIGKILL a stage of the broker (any: front,
tokenizer, router, writer, dispatch, completion, vectors, a local worker),
SIGKILL a remote worker, SIGKILL the whole broker and start it again (half
the time damaging one input segment first: cut mid-slot, or a header byte
flipped; lost items must end as `corrupt_input` error lines),
SIGKILL a results client or a submit and run it again, or SIGSTOP a worker
for longer than its lease and let it go later. A client that fails (the
broker was down too long) is run again with the same arguments, as a user
would.

With `--power-cuts` (bench/chaos_power.py) the data dir and the results
clients' output files are on power-cut disks, and 30% of the actions cut
the power instead: of the broker's machine (every stage and what was not
fsynced go; the broker starts on the rest, torn writes and all) or of the
results clients' (they run again on what they fsynced). The summary then goes
to its own section of docs/RELIABILITY.md.

At the end it stops killing, lets every job finish and be fetched, and
asserts for every job: each input line has exactly one outcome (an output
line or an error line) across its output and error files, no custom_id
twice, the poison item is an error, the job's counters equal the files; then
the broker stops cleanly (exit 0), `python run.py check` is clean and every
input segment is collected. A job not finished 600 s after the kills stopped
is a failure that names what dispatch still holds (segment, slots, session,
from its `status` answer). It prints the kills of each kind survived and the
longest a job had work pending after the kills stopped and, unless
`--quick`, writes the summary to docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import machine
from bench.chaos_fleet import (
    ECHO_FAULTS,
    LEASE_S,
    REPO,
    BrokerProcess,
    Client,
    JobInput,
    run_py,
    write_config,
    write_job,
)
from bench.chaos_power import BROKER_CUT, CLIENT_CUT, PowerCuts
from bench.report import write_section
from gpu.worker.options import WorkerOptions

DOC = REPO / "docs" / "RELIABILITY.md"
LYING_WORKER = REPO / "tests" / "procs" / "lying_worker.py"
DAMAGE_CHANCE = 0.5  # of a whole-broker kill: one input segment is damaged before the restart
POWER_CUT_CHANCE = 0.3  # --power-cuts: of the actions, a power cut (the rest as without)
CLIENT_CUT_SHARE = 0.2  # of the power cuts: of the results clients' disk
STAGES = ("front", "tokenizer", "router", "writer", "dispatch", "completion", "vectors", "worker")


@dataclass
class Job:
    spec: JobInput
    submit: Client
    fetch: Client | None = None
    out: Path = Path()
    err: Path = Path()


@dataclass
class Report:
    seconds: float = 0.0
    kills: Counter = field(default_factory=Counter)
    jobs: int = 0
    lines: int = 0
    lost: int = 0
    doubled: int = 0
    counter_mismatches: int = 0
    problems: list[str] = field(default_factory=list)
    submit_runs: int = 0
    fetch_runs: int = 0
    poison_deaths: int = 0
    settle_s: float = 0.0  # the longest a job had work pending after the kills stopped
    damage: Counter = field(default_factory=Counter)  # input segments damaged while it was down
    liar_runs: int = 0  # runs of the lying worker (it is restarted like the others)
    power_cuts: Counter = field(default_factory=Counter)  # --power-cuts: of which machine

    @property
    def total_kills(self) -> int:
        return sum(n for kind, n in self.kills.items() if kind != "SIGSTOP worker")

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.counter_mismatches or self.problems)

    def as_json(self) -> dict:
        """Every field, and `ok` and `total_kills`: what `--report-json` writes."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**fields, "ok": self.ok, "total_kills": self.total_kills}


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
        self._check_data_dir()
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
                    self._verify(job)

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
            self.power.cut_client()
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
            stuck = self._stuck_work()
        for job in self.jobs:
            self.report.problems.append(
                f"job {job.spec.job_id} did not finish within {timeout_s:.0f} s "
                f"after the kills stopped ({self._job_counts(job)}); {stuck}"
            )

    def _status(self, *job: str) -> dict:
        """`run.py status [JOB] --json`: the broker's own answer ({} if it gave none)."""
        answer = subprocess.run(
            run_py("status", *job, "--json", "--config", str(self.config)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        return json.loads(answer.stdout) if answer.returncode == 0 else {}

    def _job_counts(self, job: Job) -> str:
        info = self._status(job.spec.job_id)
        if not info:
            return "no status answer"
        return (
            f"state {info.get('state')}, {info.get('completed')} completed + "
            f"{info.get('failed')} failed of {info.get('total')}"
        )

    def _stuck_work(self) -> str:
        """What dispatch says is still out or queued: (segment, slots, session) per lease."""
        info = self._status()
        if not info:
            return "dispatch gave no status answer"
        leases = [
            f"segment {b['segment']} slots {b['slots']}{'...' if b['items'] > len(b['slots']) else ''}"
            f" with session {b['session']} for {b['held_s']} s"
            + (" (answered, retire pending)" if b["answered"] else "")
            + (" (session stalled)" if b["stalled"] else "")
            for b in info.get("leases", [])
        ]
        queued = [f"segment {q['segment']}: {q['queued']} queued" for q in info.get("queues", [])]
        workers = [
            f"{w['session']} ({w['model']}, {w['batches']} batch(es), silent {w['silent_s']} s"
            + (", stalled" if w.get("stalled") else "")
            + ")"
            for w in info.get("workers", [])
        ]
        return (
            f"dispatch: on lease: {'; '.join(leases) or 'nothing'}; "
            f"queued: {'; '.join(queued) or 'nothing'}; workers: {'; '.join(workers) or 'none'}"
        )

    def _verify(self, job: Job) -> None:
        spec, report = job.spec, self.report
        report.jobs += 1
        report.lines += spec.lines
        report.submit_runs += job.submit.runs
        report.fetch_runs += job.fetch.runs
        seen: Counter = Counter()
        outputs = errors = 0
        poison_error = None
        for path, is_error in ((job.out, False), (job.err, True)):
            for raw in path.read_text().splitlines() if path.exists() else []:
                line = json.loads(raw)
                custom_id = line["custom_id"]
                if custom_id is None:  # a broken line: `<job>-line-<n>`
                    number = int(line["id"].rsplit("-", 1)[1])
                else:
                    number = int(custom_id.rsplit("-", 1)[1])
                seen[number] += 1
                outputs += not is_error
                errors += is_error
                if number == spec.poison_line:
                    poison_error = line["error"] if is_error else "an output line"
        lost = [n for n in range(1, spec.lines + 1) if not seen[n]]
        doubled = [n for n, c in seen.items() if c > 1]
        report.lost += len(lost)
        report.doubled += len(doubled)
        if lost or doubled:
            report.problems.append(
                f"job {spec.job_id}: lost lines {lost[:10]}, doubled {doubled[:10]}"
            )
        if not isinstance(poison_error, dict):
            report.problems.append(f"job {spec.job_id}: the poison item ended as {poison_error!r}")
        info = self._status(spec.job_id)
        if info.get("state") != "completed":
            report.problems.append(f"job {spec.job_id}: state {info.get('state')!r} once fetched")
        elif info["completed"] != outputs or info["failed"] != errors:
            report.counter_mismatches += 1
            report.problems.append(
                f"job {spec.job_id}: counters say {info['completed']} completed and "
                f"{info['failed']} failed; the files hold {outputs} and {errors}"
            )

    def _check_data_dir(self) -> None:
        check = subprocess.run(
            run_py("check", "--config", str(self.config)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        if check.returncode != 0:
            self.report.problems.append(f"check found: {check.stdout.strip()[-2000:]}")
        # Collected: a last start lets the collector remove the finished jobs' segments.
        self.broker.start()
        segments = self.root / "data" / "segments"
        deadline = time.monotonic() + 60
        while any(segments.glob("in-*.seg")) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p.name for p in segments.glob("in-*.seg"))
        if left:
            self.report.problems.append(f"{len(left)} input segment(s) never collected: {left[:5]}")
        if self.broker.stop() != 0:
            self.report.problems.append("the broker did not stop cleanly after the check")


def _address(config: Path, section: str, key: str) -> str:
    import tomllib

    return tomllib.loads(config.read_text())[section][key]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def summary(report: Report, command: str, facts: dict) -> str:
    kinds = sorted(report.kills.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [
        "## Chaos run (bench/chaos.py)",
        "",
        f"Command: `{command}` ({report.seconds / 60:.1f} min)",
        "",
        *[f"* {name}: {value}" for name, value in facts.items()],
        "",
        "| what | count |",
        "|---|---|",
        *[
            f"| SIGSTOPped past the lease, then resumed: worker | {n:,} |"
            if kind == "SIGSTOP worker"
            else f"| killed: {kind} | {n:,} |"
            for kind, n in kinds
        ],
        f"| kills in all (SIGSTOPs not counted) | {report.total_kills:,} |",
        *[f"| power cut: {kind} | {n:,} |" for kind, n in sorted(report.power_cuts.items())],
        *([f"| power cuts | {sum(report.power_cuts.values()):,} |"] if report.power_cuts else []),
        *[
            f"| damaged while the broker was down: {kind} | {n:,} |"
            for kind, n in report.damage.items()
        ],
        f"| runs of a lying worker (damaged results, refused by completion) | {report.liar_runs:,} |",
        f"| remote workers killed by the poison item and restarted | {report.poison_deaths:,} |",
        f"| jobs | {report.jobs:,} |",
        f"| input lines | {report.lines:,} |",
        f"| submit runs (a killed or failed submit is run again) | {report.submit_runs:,} |",
        f"| results runs (likewise) | {report.fetch_runs:,} |",
        f"| lines lost | {report.lost:,} |",
        f"| lines with two outcomes | {report.doubled:,} |",
        f"| jobs whose counters disagree with their files | {report.counter_mismatches:,} |",
        f"| longest a job had work pending after the kills stopped | {report.settle_s:.1f} s |",
        "",
        "Result: "
        + (
            "**held**: zero lost or doubled outcomes, check clean, segments collected."
            if report.ok
            else "**FAILED**:"
        ),
        *[f"* {p}" for p in report.problems[:20]],
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--items", type=int, default=2000, help="lines per job")
    parser.add_argument("--jobs", type=int, default=2, help="jobs in flight at once")
    parser.add_argument("--quick", action="store_true", help="do not write docs/RELIABILITY.md")
    parser.add_argument(
        "--damage",
        type=float,
        default=DAMAGE_CHANCE,
        help="chance that a whole-broker kill damages one input segment",
    )
    parser.add_argument(
        "--broker-kill-by",
        type=float,
        metavar="S",
        help="kill the whole broker at least once, at the latest S seconds into the run",
    )
    parser.add_argument(
        "--power-cuts",
        action="store_true",
        help="the data dir and the results' files on power-cut disks (bench/chaos_power.py);"
        f" {POWER_CUT_CHANCE:.0%} of the actions cut the power instead of a kill",
    )
    parser.add_argument("--root", type=Path, help="a new directory for the run (else var/)")
    parser.add_argument("--report-json", type=Path, help="also write the report here, as JSON")
    args = parser.parse_args()
    root = args.root or REPO / "var" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    facts = machine.describe(root)

    def progress(report: Report, elapsed: float, finished: int) -> None:
        print(
            f"chaos: {elapsed / 60:.1f} min, {report.total_kills} kills, "
            f"{sum(report.power_cuts.values())} power cuts, {finished} jobs done",
            file=sys.stderr,
            flush=True,
        )

    power = PowerCuts(root, args.seed) if args.power_cuts else None
    try:
        chaos = Chaos(
            root,
            args.seed,
            args.items,
            args.jobs,
            damage=args.damage,
            broker_kill_by_s=args.broker_kill_by,
            power=power,
        )
        report = chaos.run(args.minutes * 60, progress)
    finally:
        if power is not None:
            power.close()
    if args.report_json is not None:
        args.report_json.write_text(json.dumps(report.as_json(), indent=1))
    text = summary(report, machine.command_line(), facts)
    print(text)
    if not args.quick:
        write_section(DOC, "chaos-power" if args.power_cuts else "chaos", text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
