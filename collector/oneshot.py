"""`python run.py batch IN.jsonl -o OUT.jsonl`: one file through a private broker, resumably.

Like `vllm run-batch`, with the broker's guarantees:

1. The state directory `OUT.fabric/` beside the output holds the generated
   config (`batch.toml`, for `--model NAME --engine E`, each `--alias A` another
   name the lines may give the model; loopback ports picked
   free on each run), the broker's stderr (`broker.err`), one mark per job
   whose results go to OUT (`jobs/<job id>`), and, without `--config`, the
   data dir (`data/`). With `--config F` the broker runs on F (its data dir,
   ports and workers).
2. If a broker of an earlier run of this data dir is still stopping, wait for
   its lock (a killed run's broker is told SIGTERM by the kernel and drains).
3. Start `run.py --config CFG` as a child (the real pipeline, the supervisor,
   its local workers), in this process group.
4. Submit IN as job `batch-<hash of IN's bytes and OUT's path>`: a rerun with
   the same arguments is the same job, and its chunks already durable are
   skipped (nothing is stored twice).
5. Follow the job's results into OUT and OUT.errors.jsonl with the results
   client, which writes each custom_id once and acknowledges a page only after
   both files are on disk; a progress bar (rich on a terminal, a line every
   2 s otherwise) shows the job's counters.
6. SIGTERM the broker and wait for it to drain; exit 0 when every line has its
   outcome (a result or an error line), 7 otherwise.

Killed at any point and run again with the same arguments, it resumes: OUT
keeps what it holds (a torn last line is cut), lines done are not run again.
An OUT that exists but was not written for this job (another input) is
refused, never mixed.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import exitcodes
from pipeline.datadir import LOCK_NAME
from pipeline.errors import ConfigError, FabricError
from pipeline.job_states import is_terminal
from pipeline.ports import free_loopback_ports
from pipeline.topology import client_address

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0  # for the broker to answer (recovery of a large data dir, model loads)
STOP_TIMEOUT_S = 120.0  # for the broker to drain after SIGTERM
ERRORS_SUFFIX = ".errors.jsonl"
PR_SET_PDEATHSIG = 1
# What --engine E brings without --tokenizer: the tokenizer and the longest prompt.
ENGINE_TOKENIZERS = {"minilm": ("gpu/minilm/tokenizer.json", 256)}


class OneShotError(FabricError):
    """The one-shot run cannot go on: bad arguments, an OUT of another input, a broker gone."""


@dataclass(frozen=True)
class OneShot:
    """What one `run.py batch` run was asked to do."""

    input: Path
    output: Path
    config: Path | None = None
    model: str | None = None
    engine: str | None = None
    tokenizer: str | None = None
    workers: int = 1
    aliases: tuple[str, ...] = ()  # --alias: other names the lines may give the model

    @property
    def state_dir(self) -> Path:
        return self.output.with_name(self.output.name + ".fabric")

    @property
    def errors(self) -> Path:
        return self.output.with_name(self.output.name + ERRORS_SUFFIX)

    def job_id(self) -> str:
        """`batch-` and a hash of the input's bytes and the output's absolute path."""
        digest = hashlib.blake2b(digest_size=10)
        digest.update(str(self.output.resolve()).encode() + b"\0")
        with open(self.input, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return "batch-" + digest.hexdigest()


def write_config(run: OneShot) -> Path:
    """The config of a private broker for one model, in the state dir (rewritten each run)."""
    from config.defaults import ENGINE_ENDPOINTS
    from pipeline.model_names import NAME_RULE, name_problem

    if not run.model:
        raise OneShotError("name the model: --model NAME (and --engine E), or --config FILE")
    for flag, name in (("--model", run.model), *(("--alias", a) for a in run.aliases)):
        problem = name_problem(name)  # said here, naming the flag, not the generated file
        if problem is not None:
            raise OneShotError(f"{flag} {name!r} {problem}; a model name or alias is {NAME_RULE}")
    aliases = [a for a in dict.fromkeys(run.aliases) if a != run.model]  # each name once
    engine = run.engine or (run.model if run.model in ENGINE_ENDPOINTS else None)
    if engine not in ENGINE_ENDPOINTS:
        raise OneShotError(
            f"--model {run.model} is not an engine name: say which engine runs it, --engine "
            f"{'|'.join(ENGINE_ENDPOINTS)}"
            if engine is None
            else f"--engine {engine} is not an engine: use one of {', '.join(ENGINE_ENDPOINTS)}"
        )
    tokenizer, max_tokens = ENGINE_TOKENIZERS.get(engine, ("", 32768))
    if run.tokenizer is not None:
        tokenizer = run.tokenizer
    if tokenizer and not os.path.isabs(tokenizer):
        tokenizer = str((REPO / tokenizer) if (REPO / tokenizer).exists() else Path(tokenizer))
    ports = free_loopback_ports(4)
    text = f"""# Written by `run.py batch` for {run.output}; rewritten on every run.
[broker]
data_dir = "{run.state_dir / "data"}"
[ingest]
bind = "tcp://127.0.0.1:{ports[0]}"
[dispatch]
bind = "tcp://127.0.0.1:{ports[1]}"
heartbeat_bind = "tcp://127.0.0.1:{ports[2]}"
reregister_grace_s = 1.0
[completion]
bind = "tcp://127.0.0.1:{ports[3]}"
[vectors]
bind = "ipc://{_short_ipc(run)}"
[metrics]
bind = ""
[workers]
local = {run.workers}
[[models]]
name = "{run.model}"
engine = "{engine}"
tokenizer = "{tokenizer}"
max_tokens = {max_tokens}
aliases = {json.dumps(aliases)}
"""
    path = run.state_dir / "batch.toml"
    path.write_text(text)
    return path


def _short_ipc(run: OneShot) -> str:
    """An ipc path for the vector manager (unused here, but every broker runs one)."""
    digest = hashlib.blake2b(str(run.state_dir.resolve()).encode(), digest_size=6).hexdigest()
    return f"/tmp/fabric-batch-{digest}.ipc"


def _wait_for_lock(data_path: Path, say) -> None:
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
                    raise OneShotError(
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


class _Progress:
    """The job's counters on stderr: a rich bar on a terminal, a plain line every 2 s otherwise."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.said = ""
        self.bar = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self.task = self.bar.add_task(label, total=None, note="")
            self.bar.start()

    def show(self, done: int, total: int | None, note: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, note=note)
            return
        now = time.monotonic()
        of = f"/{total}" if total is not None else ""
        line = f"{self.label}: {done}{of} lines done; {note}"
        if (line != self.said and now - self.last >= 2.0) or now - self.last >= 30.0:
            self.last, self.said = now, line
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _claim_output(run: OneShot, job_id: str) -> None:
    """Mark OUT as this job's; refuse an OUT (or its errors file) written for another job."""
    marks = run.state_dir / "jobs"
    mark = marks / job_id
    if mark.exists():
        return
    for path in (run.output, run.errors):
        if path.exists() and path.stat().st_size:
            raise OneShotError(
                f"{path} exists but was not written for this input (job {job_id}): the input "
                f"changed, or the file is another's; move it away or choose another -o"
            )
    from pipeline.durable import fsync_dir

    marks.mkdir(parents=True, exist_ok=True)
    mark.write_text(f"{run.input.resolve()}\n")
    fsync_dir(marks)


def run_oneshot(run: OneShot) -> int:
    """Run the file to the end through a private broker; the exit code of `run.py batch`."""
    from config import load_settings

    def say(line: str) -> None:
        print(f"batch: {line}", file=sys.stderr, flush=True)

    if not run.input.is_file():
        raise OneShotError(f"input {run.input} is not a file; pass an OpenAI Batch JSONL file")
    run.state_dir.mkdir(parents=True, exist_ok=True)
    config = run.config or write_config(run)
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        if run.config is not None:
            raise
        raise OneShotError(  # the file is ours: what is wrong came from the flags
            f"--model/--engine/--tokenizer/--alias give a broker config that is refused: {exc}"
        ) from None
    job_id = run.job_id()
    _claim_output(run, job_id)
    _wait_for_lock(settings.data_path, say)
    if not settings.worker_groups:
        say(f"{config} starts no local workers: the lines wait for workers of other hosts")
    say(f"job {job_id}: {run.input} -> {run.output}; broker on {settings.data_path}")
    err = open(run.state_dir / "broker.err", "ab")  # noqa: SIM115 - lives as long as the broker
    broker = subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=err,  # runs in this working directory: --config's relative paths mean the same
        preexec_fn=_term_with_parent,
    )
    err.close()
    progress = _Progress(job_id)
    try:
        code = _drive(run, settings, job_id, broker, progress, say)
    except KeyboardInterrupt:
        progress.close()
        say("interrupted; stopping the broker (run the same command again to resume)")
        _stop(broker)
        return 130
    except BaseException:
        progress.close()
        _stop(broker)
        raise
    progress.close()
    stopped = _stop(broker)
    if stopped != 0:
        say(f"the broker exited {stopped} (see {run.state_dir / 'broker.err'})")
    return code if stopped == 0 else exitcodes.FAILED


def _drive(run: OneShot, settings, job_id: str, broker, progress: _Progress, say) -> int:
    from collector.delivery.decoders import model_decoders
    from collector.results_client import ResultsClient
    from ingest.submit_client import Producer
    from pipeline.errors import BrokerUnavailableError
    from pipeline.security import client_curve

    curve = client_curve(settings.security, None, None)  # the config's keys, if it sets any

    def alive() -> None:
        if broker.poll() is not None:
            raise OneShotError(
                f"the broker stopped (exit {broker.returncode}); see "
                f"{run.state_dir / 'broker.err'} and {settings.data_path / 'log'}; run the same "
                f"command again to resume"
            )

    address = client_address(settings.ingest.bind)
    # patient: the broker started a moment ago and may not listen yet
    with Producer(address, timeout_s=30.0, attempts=20, curve=curve, patient=True) as producer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the front answers once recovery is done and the stages are up
            alive()
            try:
                producer.job_status(job_id)
                break
            except BrokerUnavailableError:
                if time.monotonic() > deadline:
                    raise OneShotError(
                        f"the broker did not answer within {START_TIMEOUT_S:.0f} s; see "
                        f"{run.state_dir / 'broker.err'}"
                    ) from None
        report = producer.submit_file(  # a rerun skips the chunks already durable
            run.input,
            job_id,
            progress=lambda r, lines: progress.show(0, None, f"submitting: line {lines}"),
        )
    say(
        f"job {job_id}: {report.stored} lines queued, {report.rejected} rejected "
        f"(they get error lines)"
    )
    latest: list = [None]
    failure: list = []

    def follow() -> None:
        try:
            address = client_address(settings.completion.bind)
            with ResultsClient(address, timeout_s=10.0, curve=curve, patient=True) as c:
                latest[0] = c.fetch(
                    job_id,
                    str(run.output),
                    str(run.errors),
                    follow=True,
                    decoders=model_decoders(settings),
                    progress=lambda report: latest.__setitem__(0, report),
                )
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    follower = threading.Thread(target=follow, name="results", daemon=True)
    follower.start()
    written = 0
    while follower.is_alive():
        follower.join(0.2)
        if failure:
            break
        alive()
        report = latest[0]
        if report is not None and report.info:
            info = report.info
            written = report.written + report.errors
            progress.show(
                int(info["completed"]) + int(info["failed"]),
                info.get("total"),
                f"{info['state']}; {written} lines written this run",
            )
    if failure:
        raise failure[0]
    report = latest[0]
    info = report.info or {}
    total, failed = info.get("total"), int(info.get("failed", 0))
    done = int(info.get("completed", 0)) + failed  # `completed` counts results, not errors
    progress.show(done, total, info.get("state", "?"))
    whole = is_terminal(info.get("state")) and total is not None and done >= total
    say(
        f"job {job_id}: {info.get('state')}; {done} of {total} lines have their outcome "
        f"({failed} errors); this run wrote {report.written} results to {run.output} and "
        f"{report.errors} error lines to {run.errors}"
    )
    return exitcodes.OK if whole else exitcodes.FAILED


def _stop(broker: subprocess.Popen) -> int:
    """SIGTERM the broker and wait for it to drain (SIGKILL after STOP_TIMEOUT_S)."""
    if broker.poll() is None:
        broker.send_signal(signal.SIGTERM)
        try:
            return broker.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            broker.kill()
            return broker.wait()
    return broker.returncode


def add_parser(commands) -> None:
    """`run.py batch`: its arguments, on run.py's subcommands."""
    batch = commands.add_parser(
        "batch", help="one-shot: run a JSONL file through a private broker (resumable)"
    )
    batch.add_argument("input", type=Path, help="OpenAI Batch JSONL input file")
    batch.add_argument(
        "-o", "--output", type=Path, required=True, help="output JSONL (errors: OUT.errors.jsonl)"
    )
    batch.add_argument(
        "--config", type=Path, help="serve with this config (its data dir, models, workers)"
    )
    batch.add_argument("--model", help="without --config: the model the lines name")
    batch.add_argument("--engine", help="without --config: its engine (default: the model name)")
    batch.add_argument(
        "--tokenizer", help="without --config: tokenizer.json for text lines (minilm: its own)"
    )
    batch.add_argument(
        "--workers", type=int, default=1, help="without --config: local worker processes"
    )
    batch.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="without --config: another name the lines may give the model, e.g. gpt-4o-mini "
        "(repeatable); the output's model repeats it",
    )
    batch.set_defaults(handler=_batch)


def _batch(args) -> int:
    if args.config and (args.model or args.engine or args.tokenizer or args.alias):
        raise OneShotError(
            "give either --config or --model/--engine/--tokenizer/--alias, not both (with "
            "--config, list a model's other names in its [[models]] table: aliases = [...])"
        )
    if args.workers < 1:
        raise OneShotError(f"--workers {args.workers}: at least 1 local worker runs the file")
    return run_oneshot(
        OneShot(
            args.input.absolute(),
            args.output.absolute(),
            args.config,
            args.model,
            args.engine,
            args.tokenizer,
            args.workers,
            tuple(args.alias),
        )
    )
