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
   both files are on disk; a progress line (cli/progress_line.py) shows
   the job's counters, its rate and the time left, as `status JOB` has them.
   A local worker whose engine cannot start (exit ENGINE_CANNOT_START in the
   supervisor's report) stops the run with the engine's own message, instead
   of waiting while the supervisor restarts it.
6. SIGTERM the broker and wait for it to drain (assembly/private_broker.py);
   exit 0 when every line has its outcome (a result or an error line), 9 when
   every line has one but none succeeded, 7 otherwise (pipeline/core/exitcodes.py).

Killed at any point and run again with the same arguments, it resumes (and
says how many lines OUT already holds): OUT keeps what it holds (a torn last
line is cut), lines done are not run again. An OUT that exists but was not
written for this job (another input) is refused, never mixed. A run that
fails before its broker starts removes the state dir it made; one whose OUT
cannot be written says which path and exits 8.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from assembly.private_broker import (
    engine_cannot_start,
    start_broker,
    stop_broker,
    wait_for_lock,
    wait_ready,
    write_config,
)
from cli.batch_output import first_error, resuming_line
from cli.common import limit_options, limits_of
from cli.progress_line import ProgressLine, bar
from collector.status_view import job_done, job_fields
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError, FabricError, OutputError
from pipeline.core.job_states import is_terminal
from pipeline.transport.topology import client_address

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0  # for the broker to answer (recovery of a large data dir, model loads)
ERRORS_SUFFIX = ".errors.jsonl"
# What --engine E brings without --tokenizer: the tokenizer and the longest prompt.
ENGINE_TOKENIZERS = {"minilm": ("gpu/minilm/tokenizer.json", 256)}
DEFAULT_REUSE_INDEX = Path("~/.cache/inference-fabric/reuse")  # `batch --reuse` without --config


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
    limits: dict | None = None  # --max-errors and the other caps (pipeline/core/job_limits.py)
    reuse: bool = False  # --reuse: lines take stored results of identical earlier requests
    reuse_index: Path | None = None  # without --config: the index shared by every run

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


def batch_config(run: OneShot) -> Path:
    """The config of a private broker for one model, in the state dir (rewritten each run)."""
    from config.defaults import ENGINE_ENDPOINTS
    from pipeline.store.model_names import NAME_RULE, name_problem

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
    model = {
        "name": run.model,
        "engine": engine,
        "tokenizer": tokenizer,
        "max_tokens": max_tokens,
        "aliases": aliases,
    }
    return write_config(
        run.state_dir / "batch.toml",
        f"Written by `run.py batch` for {run.output}; rewritten on every run.",
        run.state_dir / "data",
        [model],
        run.workers,
        vectors_bind=f"ipc://{_short_ipc(run)}",
    )


def _short_ipc(run: OneShot) -> str:
    """An ipc path for the vector manager (unused here, but every broker runs one)."""
    digest = hashlib.blake2b(str(run.state_dir.resolve()).encode(), digest_size=6).hexdigest()
    return f"/tmp/fabric-batch-{digest}.ipc"


def _make_state_dir(run: OneShot) -> bool:
    """Make OUT.fabric/ beside OUT (True when this run made it); OutputError naming the path
    when OUT, its errors file or the state dir cannot be written there."""
    from pipeline.store.durable import fsync_dir

    made = not run.state_dir.exists()
    path = run.state_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
        for path in (run.state_dir / "broker.err", run.output, run.errors):
            if path.exists() or path.parent == run.state_dir:
                with open(path, "ab"):  # opened for appending, as they will be: nothing changes
                    pass
        for path in (run.state_dir, run.output.parent):  # their names survive a power cut
            fsync_dir(path)
    except OSError as exc:
        raise OutputError(
            f"cannot write {exc.filename or path}: {exc.strerror or exc}; -o {run.output} "
            f"needs a directory this user can write, for OUT, {run.errors.name} and the "
            f"state dir {run.state_dir.name}/ beside it: choose another -o or make it writable"
        ) from None
    return made


def _claim_output(run: OneShot, job_id: str) -> bool:
    """Mark OUT as this job's; refuse an OUT (or its errors file) written for another job.
    True when an earlier run had marked it: this run resumes."""
    marks = run.state_dir / "jobs"
    mark = marks / job_id
    if mark.exists():
        return True
    for path in (run.output, run.errors):
        if path.exists() and path.stat().st_size:
            raise OneShotError(
                f"{path} exists but was not written for this input (job {job_id}): the input "
                f"changed, or the file is another's; move it away or choose another -o"
            )
    from pipeline.store.durable import write_whole

    marks.mkdir(parents=True, exist_ok=True)
    # durable, name and all, before OUT gets a line: after a power cut, OUT with lines and
    # no mark reads as another job's file
    write_whole(mark, f"{run.input.resolve()}\n".encode(), also_sync=(run.state_dir,))
    return False


def run_oneshot(run: OneShot) -> int:
    """Run the file to the end through a private broker; the exit code of `run.py batch`."""
    from config import load_settings

    progress = ProgressLine(every_s=2.0)

    def say(line: str) -> None:
        progress.say(f"batch: {line}")

    if not run.input.is_file():
        raise OneShotError(f"input {run.input} is not a file; pass an OpenAI Batch JSONL file")
    made = _make_state_dir(run)
    try:  # a run that fails before its broker starts leaves no state dir it made
        config = run.config or batch_config(run)
        try:
            settings = load_settings(config)
        except ConfigError as exc:
            if run.config is not None:
                raise
            raise OneShotError(  # the file is ours: what is wrong came from the flags
                f"--model/--engine/--tokenizer/--alias give a broker config that is refused: {exc}"
            ) from None
        job_id = run.job_id()
        resumed = _claim_output(run, job_id)
        wait_for_lock(settings.data_path, say)
        if run.reuse and run.config is None:
            _share_reuse_index(settings.data_path, run.reuse_index or DEFAULT_REUSE_INDEX, say)
    except BaseException:
        if made:
            shutil.rmtree(run.state_dir, ignore_errors=True)
        raise
    if not settings.worker_groups:
        say(f"{config} starts no local workers: the lines wait for workers of other hosts")
    say(f"job {job_id}: {run.input} -> {run.output}; broker on {settings.data_path}")
    if resumed:
        say(resuming_line(run.input, run.output, run.errors))
    broker = start_broker(config, run.state_dir / "broker.err")
    try:
        code = _drive(run, settings, job_id, broker, progress, say)
    except KeyboardInterrupt:
        progress.close()
        stop_broker(broker, settings, say)  # says it drains; a second Ctrl-C kills it
        return exitcodes.INTERRUPTED
    except BaseException:
        progress.close()
        stop_broker(broker, settings)
        raise
    progress.close()
    stopped = stop_broker(broker, settings)
    if stopped != 0:
        say(f"the broker exited {stopped} (see {run.state_dir / 'broker.err'})")
    return code if stopped == 0 else exitcodes.FAILED


def _drive(run: OneShot, settings, job_id: str, broker, progress: ProgressLine, say) -> int:
    from collector.delivery.decoders import model_decoders
    from collector.results_client import ResultsClient
    from ingest.submit_client import Producer
    from pipeline.transport.security import client_curve

    curve = client_curve(settings.security, None, None)  # the config's keys, if it sets any

    def alive() -> None:
        if broker.poll() is not None:
            raise OneShotError(
                f"the broker stopped (exit {broker.returncode}); see "
                f"{run.state_dir / 'broker.err'} and {settings.data_path / 'log'}; run the same "
                f"command again to resume"
            )
        stuck = engine_cannot_start(settings.data_path)  # a restart would fail the same way
        if stuck:
            raise OneShotError(
                f"{stuck}; fix its model or engine options, then run the same command again "
                "to resume"
            )

    address = client_address(settings.ingest.bind)
    # patient: the broker started a moment ago and may not listen yet
    with Producer(address, timeout_s=30.0, attempts=20, curve=curve, patient=True) as producer:
        if not wait_ready(producer, job_id, alive, START_TIMEOUT_S):
            raise OneShotError(
                f"the broker did not answer within {START_TIMEOUT_S:.0f} s; see "
                f"{run.state_dir / 'broker.err'}"
            )
        report = producer.submit_file(  # a rerun skips the chunks already durable
            run.input,
            job_id,
            limits=run.limits,
            reuse=run.reuse,
            progress=lambda r, lines: progress.show(f"{job_id}: submitting, line {lines}"),
        )
    say(_queued(job_id, report))
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
    while follower.is_alive():
        follower.join(0.2)
        if failure:
            break
        alive()
        report = latest[0]
        if report is not None and report.info:
            progress.show(_progress_text(job_id, report, progress.tty))
    if failure:
        raise failure[0]
    report = latest[0]
    info = report.info or {}
    if info:
        progress.show(_progress_text(job_id, report, progress.tty), final=True)
    done, total = job_done(info)
    failed = int(info.get("failed", 0))
    reused = f", {info['reused']} reused" if info.get("reused") is not None else ""
    say(
        f"job {job_id}: {info.get('state')}; {done} of {total} lines have their outcome "
        f"({failed} errors{reused}); this run wrote {report.written} results to {run.output} and "
        f"{report.errors} error lines to {run.errors}"
    )
    if not (is_terminal(info.get("state")) and total is not None and done >= total):
        return exitcodes.FAILED
    if total and not int(info.get("completed", 0)):
        say(f"no line succeeded: all {total} lines failed; {first_error(run.errors)}")
        return exitcodes.ALL_FAILED
    return exitcodes.OK


def _share_reuse_index(data_path: Path, index: Path, say) -> None:
    """Make the private broker's reuse index (`<data dir>/reuse`) the shared one at `index`,
    so that every `batch --reuse` run finds what earlier runs, of any input, computed; one
    broker at a time indexes into it (pipeline/store/reuse_store.py locks it)."""
    from pipeline.store.reuse_store import REUSE_DIR

    index = index.expanduser().absolute()
    link = data_path / REUSE_DIR
    try:
        index.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) == index:
            return
        if link.is_symlink():
            link.unlink()
        elif link.exists():  # an index of this data dir's own: kept, and used
            say(f"--reuse: {link} is this output's own index; {index} is not used")
            return
        data_path.mkdir(parents=True, exist_ok=True)
        link.symlink_to(index, target_is_directory=True)
    except OSError as exc:
        raise OutputError(
            f"--reuse-index {index}: {exc.strerror or exc}; choose a directory this user can "
            "write with --reuse-index DIR"
        ) from None


def _queued(job_id: str, report) -> str:
    """What submitting did this run; on a rerun, what an earlier run had already queued."""
    stored, rejected = (
        report.stored - report.stored_before,
        report.rejected - report.rejected_before,
    )
    if not (report.stored_before or report.rejected_before):
        return f"job {job_id}: {stored} lines queued, {rejected} rejected (they get error lines)"
    if stored or rejected:
        return (
            f"job {job_id}: {stored} more lines queued, {rejected} rejected; an earlier run "
            f"had queued {report.stored_before} and rejected {report.rejected_before}"
        )
    return (
        f"job {job_id}: an earlier run had queued every line ({report.stored} queued, "
        f"{report.rejected} rejected); nothing more to send"
    )


def _progress_text(job_id: str, report, tty: bool) -> str:
    """`JOB: 1488/2018 (74%) lines done, 95/s, 6s left; 3 failed; ...`; on a terminal
    `[#####...] 1488/2018 (74%), 95/s, 6s left; ...`, most telling first (a line redrawn in
    place is cut to the terminal's width): the job's counters, rate and time left as
    `status --watch` shows them."""
    info = report.info
    done_total, failed, rate, left = job_fields(info)
    head = f"{bar(*job_done(info), cells=20)} {done_total}" if tty else f"{job_id}: {done_total}"
    head += "" if tty else " lines done"
    left = f", {left} left" if left != "-" else ""
    return (
        f"{head}, {rate}{left}; {failed} failed; {info['state']}; "
        f"{report.written + report.errors} lines written this run"
    )


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
    batch.add_argument(
        "--reuse",
        action="store_true",
        help="lines identical to an earlier deterministic request take its stored result "
        "instead of running (docs/batch.md, Result reuse)",
    )
    batch.add_argument(
        "--reuse-index",
        type=Path,
        metavar="DIR",
        help=f"without --config: the reuse index every run shares (default {DEFAULT_REUSE_INDEX})",
    )
    limit_options(batch)
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
            limits_of(args),
            args.reuse,
            args.reuse_index,
        )
    )
