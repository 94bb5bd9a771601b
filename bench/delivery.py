"""Delivery benchmark: `run.py results JOB --all` of finished jobs, alone; a baseline client paired.

Run from the repository root (a few minutes on two cores):

    .venv/bin/python bench/delivery.py [--items N] [--embeddings M] [--repeat K]
                                       [--baseline REV] [--profile on|off] [--dir PATH]
                                       [--no-docs]

One broker (two local echo workers, batch 1024, as bench/e2e.py's paired
setup) and two finished jobs: N pre-tokenised 512-token items on
/v1/completions with max_tokens 16 (the echo worker returns each prompt's
first 16 tokens), and M items of 384 tokens on /v1/embeddings (the echo
worker returns the tokens as a 384-float embedding). Then, K times per job,
`python run.py results JOB -o OUT --errors ERR --all --config F` of the
finished job (pages from completion, formatting, writes and fsyncs, nothing
else running), timed from the process start to its exit; with `--baseline
REV` the same command from REV's tree (`git archive`) runs right before
each, so the two clients are paired by repeat on the same job and the same
load. Every client's output must be byte-identical to the first one's.
With `--profile on`, one more run of each client under py-spy (the client,
and completion serving its pages).

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import dispatch_profile, ingest_profile, machine
from bench.dispatch_common import Status, make_rows, pressure, wait_for
from bench.ingest_broker import BenchBroker, Model, cpu_times
from bench.ingest_common import Outcome, progress
from bench.report import Row, render_section, write_section
from ingest.submit_client import Producer

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/delivery.py"
MODEL = Model("echo", endpoints=("/v1/completions", "/v1/embeddings"))
TOKENS = 512
DIM = 384  # embedding length (the prompt's tokens, as floats)
MAX_TOKENS = 16
TARGET = 300_000  # items/s, completions (issue 19)
FINISH_TIMEOUT_S = 900.0
CLIENT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Job:
    name: str
    endpoint: str
    items: int
    tokens: int


@dataclass
class Fetch:
    seconds: float
    client_cpu_s: float
    completion_cpu_s: float
    client_sys_s: float  # of client_cpu_s, in the kernel (writes, page faults, fsync)
    digest: str  # sha256 of OUT, then ERR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="completions items")
    parser.add_argument("--embeddings", type=int, default=100_000, help="embedding items")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default="", help="git revision whose client runs paired")
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-delivery")
    parser.add_argument("--profile", choices=("on", "off"), default="on")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    return parser.parse_args(argv)


def baseline_tree(rev: str, root: Path) -> Path:
    """REV's files (`git archive`), to run its `run.py results` against this broker."""
    tree = root / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def fill(broker: BenchBroker, jobs: list[Job]) -> None:
    """Submit every job and wait until each has a result for every item."""
    with Producer(broker.address, window=8) as producer:
        for job in jobs:
            rows = make_rows(job.items, job.tokens)
            report = producer.submit_tokens(
                job.name,
                MODEL.name,
                rows,
                endpoint=job.endpoint,
                max_tokens=MAX_TOKENS if job.endpoint != "/v1/embeddings" else None,
                chunk_lines=4096,
            )
            if report.stored != job.items or report.rejected:
                raise RuntimeError(f"job {job.name}: stored {report.stored:,} of {job.items:,}")
    status = Status(broker)
    try:
        for job in jobs:
            wait_for(
                lambda job=job: status.job(job.name).get("state") == "completed",
                f"job {job.name} to complete",
                FINISH_TIMEOUT_S,
                every_s=0.5,
            )
    finally:
        status.close()


def fetch(
    tree: Path, broker: BenchBroker, job: Job, out_dir: Path, spies: list | None = None
) -> Fetch:
    """One `run.py results JOB --all` from `tree`, timed from its start to its exit."""
    out, err = out_dir / "out.jsonl", out_dir / "err.jsonl"
    for path in (out, err):
        path.unlink(missing_ok=True)
    command = [sys.executable, str(tree / "run.py"), "results", job.name, "-o", str(out)]
    command += ["--errors", str(err), "--all", "--config", str(broker.config)]
    completion = broker.pids()["completion-0"]
    cpu0 = sum(cpu_times(completion))
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if spies is not None:
        spies += [spy(proc.pid, out_dir / "client.txt"), spy(completion, out_dir / "compl.txt")]
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while True:  # wait4: the client's CPU time comes with its exit status
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{command} did not finish in {CLIENT_TIMEOUT_S:g} s")
        time.sleep(0.002)
    seconds = time.perf_counter() - started
    completion_cpu = sum(cpu_times(completion)) - cpu0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{command} exited with {code}: {proc.stdout.read()[-1000:]!r}")
    proc.stdout.close()
    digest = hashlib.sha256()
    lines = 0
    for path in (out, err):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
                lines += chunk.count(b"\n") if path == out else 0
    if lines != job.items:
        raise RuntimeError(f"{out}: {lines:,} lines for {job.items:,} items")
    cpu = usage.ru_utime + usage.ru_stime
    return Fetch(seconds, cpu, completion_cpu, usage.ru_stime, digest.hexdigest())


def spy(pid: int, path: Path) -> subprocess.Popen:
    binary = ingest_profile.py_spy()
    record = [binary, "record", "-r", str(ingest_profile.RATE), "-f", "raw", "-o", str(path)]
    return subprocess.Popen(
        [*record, "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def profiled(tree: Path, broker: BenchBroker, job: Job, out_dir: Path, label: str) -> list[str]:
    """One more fetch with py-spy on the client and on completion, rendered."""
    spies: list[subprocess.Popen] = []
    done = fetch(tree, broker, job, out_dir, spies)
    profiles = []
    spies[1].send_signal(signal.SIGINT)  # completion keeps running: py-spy writes on SIGINT
    labels = (("client.txt", "results client"), ("compl.txt", "completion-0"))
    for proc, (name, who) in zip(spies, labels, strict=True):
        proc.wait(timeout=60)  # the client's py-spy ended with it
        if (out_dir / name).exists():
            profiles.append(
                ingest_profile.read_raw(out_dir / name, f"{label}: {who}", done.seconds)
            )
    what = f"{label}, `results {job.name} --all`, every process sampled over the whole fetch"
    return dispatch_profile.render(profiles, job.items / done.seconds, what)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="delivery-", dir=args.dir))
    facts = machine.describe(args.dir)
    facts["CPU and I/O pressure at start"] = pressure()
    outcome = Outcome()
    started = time.perf_counter()
    jobs = [Job("completions", "/v1/completions", args.items, TOKENS)]
    if args.embeddings:
        jobs.append(Job("embeddings", "/v1/embeddings", args.embeddings, DIM))
    clients = {"this tree": REPO}
    sections = {
        "dispatch": {"session_max_batches": 8},
        "metrics": {"bind": ""},  # not read here; a fixed port clashes with other brokers
        "workers": {"local": 2, "engine": "echo", "batch_items": 1024, "batch_tokens": 1024 * 512},
    }
    broker = BenchBroker(root / "broker", [MODEL], sections=sections)
    runs: dict[tuple[str, str], list[Fetch]] = {}
    try:
        if args.baseline:
            rev = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", args.baseline],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            clients = {f"baseline {rev}": baseline_tree(args.baseline, root), **clients}
        broker.start()
        progress("broker up; submitting")
        fill(broker, jobs)
        progress("every job completed; fetching")
        out_dir = root / "fetch"
        out_dir.mkdir()
        for r in range(args.repeat):
            for job in jobs:
                for label, tree in clients.items():
                    done = fetch(tree, broker, job, out_dir)
                    runs.setdefault((job.name, label), []).append(done)
                    progress(
                        f"{job.name}, {label}, run {r + 1}: "
                        f"{job.items / done.seconds:,.0f} items/s ({done.seconds:.2f} s)"
                    )
        if args.profile == "on" and ingest_profile.py_spy():
            for label, tree in clients.items():
                outcome.profile += profiled(tree, broker, jobs[0], out_dir, label)
        outcome.checks.append(
            (f"broker stopped by SIGTERM with exit code 0: {broker.stop()}", True)
        )
    finally:
        broker.close()
        shutil.rmtree(root, ignore_errors=True)
    table, checks = rows_of(jobs, clients, runs)
    facts["load average at end"] = machine.load_average()
    facts["CPU and I/O pressure at end"] = pressure()
    tail = ["", "Profiles (one more fetch of the completions job per client):", ""]
    body = render_section(
        "Delivery alone (bench/delivery.py)",
        "`run.py results JOB --all` of finished jobs: completion's pages, the client's "
        "formatting, writes and fsyncs, nothing else running"
        + (", against a baseline client paired by repeat." if args.baseline else "."),
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        table,
        method_notes(jobs, clients),
        checks=checks + outcome.checks,
        tail=tail + outcome.profile if outcome.profile else [],
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


def rows_of(jobs: list[Job], clients: dict[str, Path], runs) -> tuple[list[Row], list]:
    table, checks = [], []
    labels = list(clients)
    for job in jobs:
        for label in labels:
            done = runs[job.name, label]
            current = label == "this tree" and job.endpoint == "/v1/completions"
            what = f"{job.name} ({job.items:,} items), {label}"
            table += [
                Row(
                    job.name,
                    f"{what}: items/s",
                    tuple(job.items / f.seconds for f in done),
                    target=f">= {TARGET:,}" if current else "",
                    at_least=TARGET if current else None,
                ),
                Row(job.name, f"{what}: client CPU, s", tuple(f.client_cpu_s for f in done)),
                Row(
                    job.name,
                    f"{what}: of which in the kernel, s",
                    tuple(f.client_sys_s for f in done),
                ),
                Row(
                    job.name, f"{what}: completion CPU, s", tuple(f.completion_cpu_s for f in done)
                ),
                Row(
                    job.name,
                    f"{what}: items per CPU second of client and completion together",
                    tuple(job.items / (f.client_cpu_s + f.completion_cpu_s) for f in done),
                ),
            ]
        if len(labels) == 2:
            old, new = (runs[job.name, label] for label in labels)
            table.append(
                Row(
                    job.name,
                    f"{job.name}: items/s, this tree / {labels[0]}, paired by repeat",
                    tuple(a.seconds / b.seconds for a, b in zip(old, new, strict=True)),
                )
            )
        digests = {f.digest for label in labels for f in runs[job.name, label]}
        checks.append(
            (
                f"{job.name}: every fetch ({len(labels)} clients) wrote byte-identical files",
                len(digests) == 1,
            )
        )
    return table, checks


def method_notes(jobs: list[Job], clients: dict[str, Path]) -> list[str]:
    return [
        "Broker: `run.py --config` with `[workers] local = 2`, engine echo, batch_items 1024, "
        "`[dispatch] session_max_batches = 8` (bench/e2e.py's paired setup), default "
        "`[completion] page_items`; the jobs are submitted with the producer SDK and "
        "completed before any fetch.",
        "Jobs: "
        + "; ".join(
            f"{j.name}: {j.items:,} items of {j.tokens} token ids on `{j.endpoint}`" for j in jobs
        )
        + f" (completions: max_tokens {MAX_TOKENS}, each line holds 16 token ids; embeddings: "
        f"{DIM} floats a line, written as JSON numbers).",
        "Timed: from the start of `python run.py results JOB -o OUT --errors ERR --all "
        "--config F` (interpreter start-up included) to its exit, every page written and "
        "fsynced; the outputs are removed before each fetch. Client CPU: its rusage at exit; "
        "completion CPU: /proc/<pid>/stat over the fetch.",
        "Reading it: on a shared machine the items/s rows follow the load (the load "
        "average above); the CPU rows and the paired ratio compare the clients. A client that "
        "asks for a page only once the last is written and fsynced (the baseline, `--all` "
        "included) takes turns with completion; one that asks ahead (docs/completion.md, "
        '"Delivery") has completion read the next page while it writes one, and fsyncs a '
        "page on a thread while it writes the next, so its items/s is bounded by the busier "
        "process, the client: on an idle 2-core host about 1 / (client CPU per item), "
        "start-up aside.",
        "Clients: "
        + ", ".join(clients)
        + ("; run alternately, each repeat in that order." if len(clients) > 1 else "."),
    ]


if __name__ == "__main__":
    sys.exit(main())
