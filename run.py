"""Inference Fabric: the one entry point (docs/operations.md).

python run.py --config prod.toml                   serve: recovery, then all stages; SIGTERM drains
python run.py demo                                 the real pipeline on a real model, on the CPU
python run.py submit FILE.jsonl [--config F | --broker ADDR] [--job-id ID] [--deliver vectors[:S]]
                   [--deadline 2h]                 earlier deadlines are dispatched first
python run.py status [JOB] [--json]                queue depth, in-flight, workers; or one job's counts
python run.py status --watch [--plain]             a live dashboard, redrawn every second
python run.py results JOB -o OUT.jsonl [--errors ERR.jsonl] [--follow] [--all]
python run.py cancel JOB                           retire the job's queued items as cancelled
python run.py vectors stats|search|export          the vector store (docs/vectors.md)
python run.py worker --broker ADDR --model M --engine E   a GPU (or CPU) worker process
python run.py check --config prod.toml [--fix]     offline consistency check of the data dir
python run.py batch IN.jsonl -o OUT.jsonl [--config F | --model M --engine E]   one-shot, resumable
python run.py keys new NAME [--dir DIR]            a CURVE key pair (docs/operations.md)

Client commands and `worker` take `--key NAME.key_secret` and `--server-key BROKER.key`
for a broker that requires CURVE keys (else `[security]` in --config).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time

from config import load_settings
from config.defaults import DEFAULTS
from pipeline.core import exitcodes
from pipeline.core.errors import (
    BrokerUnavailableError,
    ConfigError,
    DataDirLockedError,
    FabricError,
    OutputError,
)
from pipeline.core.invocation import how_to_run, note_config

COMMANDS: tuple[str, ...]
COMMANDS = ("check", "submit", "status", "results", "cancel", "vectors", "worker", "demo", "keys")
COMMANDS += ("batch",)  # collector/oneshot.py
COMMANDS += ("smollm2-dir",)  # gpu/engines/smollm2_dir.py


def _serve(args: argparse.Namespace) -> int:
    from assembly.broker import broker_supervisor

    settings = load_settings(args.config)
    return broker_supervisor(settings).run()  # says "serving" once its pre-start checks passed


def _check(args: argparse.Namespace) -> int:
    from assembly.check import check_data_dir
    from pipeline.store.datadir import DataDir

    settings = load_settings(args.config)
    data_dir = DataDir(settings.data_path)
    if not data_dir.root.exists():
        print(f"data dir {data_dir.root} does not exist yet: nothing to check")
        return exitcodes.OK
    data_dir.lock()
    try:
        report = check_data_dir(data_dir, fix=args.fix)
    finally:
        data_dir.unlock()
    for finding in report.findings:
        print(finding.line())
    for line in report.fixed:
        print(f"fixed: {line}")
    for line in report.notes:
        print(f"note: {line}")
    if report.lost and not report.remaining:
        print(
            f"not clean: {report.lost} acknowledged item(s) were lost and now have corrupt_input "
            f"error results in {data_dir.root}; their jobs can end"
        )
        return exitcodes.FINDINGS
    if report.clean:
        print(f"clean: {report.segments} segment file(s) in {data_dir.root}")
        return exitcodes.OK
    fixable = sum(f.fixable for f in report.remaining)
    hint = f"; {fixable} can be repaired with --fix" if fixable else ""
    print(f"{len(report.remaining)} finding(s) in {data_dir.root}{hint}")
    return exitcodes.FINDINGS


def _submit(args: argparse.Namespace) -> int:
    import orjson

    from collector.progress_line import ProgressLine
    from ingest.submit_client import Producer, new_job_id, parse_deadline

    deadline = parse_deadline(args.deadline, time.time()) if args.deadline else None
    address = args.broker or load_settings(args.config).ingest.bind
    job_id = args.job_id or new_job_id()
    line, started = ProgressLine(every_s=2.0), time.monotonic()

    def progress(report, lines_done: int) -> None:
        rate = lines_done / max(1e-9, time.monotonic() - started)
        line.show(
            f"submit {report.job_id}: {lines_done} lines read, {report.stored} items durable, "
            f"{report.rejected} rejected, {rate:,.0f} lines/s"
        )

    def retrying(job_id: str, chunk: int, tries: int, reason: str, delay_s: float) -> None:
        line.say(  # the broker asked for the chunk again (a full disk, say)
            f"submit {job_id}: chunk {chunk} not stored yet (try {tries} of {args.attempts}): "
            f"{reason}; sending it again in {delay_s:.1f} s"
        )

    try:
        with Producer(
            address, args.timeout, attempts=args.attempts, curve=_curve(args), on_waiting=_say
        ) as producer:
            producer.on_retry = retrying
            report = producer.submit_file(
                args.file,
                job_id,
                chunk_lines=args.chunk_lines,
                strict=args.strict,
                progress=progress,
                deliver=args.deliver,
                deadline=deadline,
            )
    except BrokerUnavailableError as exc:
        line.say(f"error: {exc}")
        return exitcodes.UNAVAILABLE
    except KeyboardInterrupt:
        again = args.argv if args.job_id else [*args.argv, "--job-id", job_id]
        line.say(
            f"submit {job_id}: interrupted; the chunks acknowledged so far are durable. "
            f"To resume, run:\n  {how_to_run()} {shlex.join(again)}"
        )
        return exitcodes.INTERRUPTED
    finally:
        line.close()
    where = "none"
    if report.errors:
        errors_path = args.errors or f"{args.file}.errors.jsonl"
        with open(errors_path, "wb") as out:
            for error in report.errors:
                out.write(orjson.dumps(error, option=orjson.OPT_APPEND_NEWLINE))
        where = errors_path
    print(
        f"job {report.job_id}: {report.stored} items queued, {report.rejected} lines rejected "
        f"(error lines: {where})",
        file=sys.stderr,
    )
    print(report.job_id)
    return exitcodes.OK


def _say(line: str) -> None:
    """A client's news for the person waiting on it ("waiting for the broker at ADDR")."""
    print(f"{line} ...", file=sys.stderr, flush=True)


def _address(args: argparse.Namespace, section: str) -> str:
    """The broker address a client command uses: --broker, else the config's (as a client)."""
    from pipeline.transport.topology import client_address

    if getattr(args, "broker", None):
        return args.broker
    return client_address(getattr(load_settings(args.config), section).bind)


def _curve(args: argparse.Namespace):
    """This client's CURVE keys: --key / --server-key over the config's [security], or None.

    The config is read only when it exists, so `--broker ADDR --key K --server-key S`
    works on a host without one.
    """
    from config.settings import SecuritySettings
    from pipeline.transport.security import client_curve

    config = getattr(args, "config", None)
    if config and (os.path.exists(config) or not getattr(args, "broker", None)):
        security = load_settings(config).security
    else:
        security = SecuritySettings(**DEFAULTS["security"])
    return client_curve(security, args.key, args.server_key)


def _decoders(args: argparse.Namespace) -> dict:
    """The decoders of the configured models, to render generated text (where their
    tokenizers are on this host); none with --broker or without the config file."""
    from collector.delivery.decoders import model_decoders

    if getattr(args, "broker", None) or not os.path.exists(args.config):
        return {}
    return model_decoders(load_settings(args.config))


def _results(args: argparse.Namespace) -> int:
    from collector.delivery.heap import keep_freed_memory
    from collector.progress_line import ProgressLine
    from collector.results_client import ResultsClient

    keep_freed_memory()  # each page's buffers reused, not faulted in afresh

    err_path = args.errors or f"{args.output}.errors.jsonl"
    line = ProgressLine(every_s=5.0)

    def progress(report) -> None:
        if report.info:
            line.show(
                f"{args.job}: {report.written} results, {report.errors} errors written; "
                f"state {report.info['state']}, pending {report.info['pending']}"
            )

    with (
        ResultsClient(
            _address(args, "completion"), args.timeout, curve=_curve(args), on_waiting=_say
        ) as client,
        line,  # ends a line redrawn in place, whatever happens
    ):
        report = client.fetch(
            args.job,
            args.output,
            err_path,
            follow=args.follow,
            everything=args.all,
            decoders=_decoders(args),
            progress=progress,
        )
    info = report.info or {}
    pending = info.get("pending")
    print(
        f"job {args.job}: {report.written} results to {args.output}, {report.errors} errors to "
        f"{err_path}; state {info.get('state')}, "
        + (f"{pending} item(s) still pending" if pending else "nothing pending"),
        file=sys.stderr,
    )
    delivered = int(info.get("completed") or 0) + int(info.get("failed") or 0)
    delivered -= int(info.get("undelivered") or 0)
    if not args.all and report.written + report.errors == 0 and delivered > 0:
        print(
            f"job {args.job}: {delivered} result(s) were already delivered by an earlier "
            f"`results`; add --all to fetch them again",
            file=sys.stderr,
        )
    return exitcodes.OK


def _vectors(args: argparse.Namespace) -> int:
    from collector.vectors.cli import run_vectors

    return run_vectors(
        args, _address(args, "vectors"), lambda: load_settings(args.config), _curve(args)
    )


def _status(args: argparse.Namespace) -> int:
    import orjson

    from collector.job_state import with_in_flight
    from collector.results_client import DispatchClient, ResultsClient

    if args.watch:
        return _watch(args)
    curve = _curve(args)
    if args.job:
        address = _address(args, "completion")
        with ResultsClient(address, args.timeout, curve=curve, on_waiting=_say) as client:
            info = client.job_status(args.job)
        info = with_in_flight(info, _dispatch_status(args, curve))
    else:
        address = _address(args, "dispatch")
        with DispatchClient(address, args.timeout, curve=curve, on_waiting=_say) as client:
            info = client.broker_status()
    if args.json:
        print(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode())
        return exitcodes.OK
    from collector.status_view import render_broker, render_job

    print(render_job(info) if args.job else render_broker(info))
    return exitcodes.OK


def _dispatch_status(args: argparse.Namespace, curve) -> dict | None:
    """Dispatch's BROKER_INFO (which items are with workers), or None: it is only a detail of
    `status JOB`, and a --broker address there is completion's, not dispatch's."""
    from collector.results_client import DispatchClient

    if args.broker:
        return None
    try:
        with DispatchClient(_address(args, "dispatch"), args.timeout, 1, curve) as client:
            return client.broker_status()
    except FabricError:
        return None


def _watch(args: argparse.Namespace) -> int:
    """`status --watch`: the dashboard (collector/status_watch.py) until Ctrl-C."""
    from collector.status_sources import Sources
    from collector.status_watch import watch
    from pipeline.transport.topology import client_address

    if args.json:
        print("error: --watch and --json do not go together", file=sys.stderr)
        return exitcodes.USAGE
    if args.interval <= 0:
        print(f"error: --interval {args.interval:g} must be > 0 seconds", file=sys.stderr)
        return exitcodes.USAGE
    curve = _curve(args)
    if args.broker:  # maybe another host: only what dispatch says
        sources = Sources(args.broker, None, None, args.timeout, only_job=args.job, curve=curve)
    else:
        settings = load_settings(args.config)
        sources = Sources(
            client_address(settings.dispatch.bind),
            client_address(settings.completion.bind),
            settings.data_path,
            args.timeout,
            only_job=args.job,
            curve=curve,
        )
    plain = args.plain or not sys.stdout.isatty() or os.environ.get("TERM") == "dumb"
    return watch(sources, sources.dispatch_address, args.interval, plain)


def _cancel(args: argparse.Namespace) -> int:
    from collector.results_client import ResultsClient

    with ResultsClient(
        _address(args, "completion"), timeout_s=args.timeout, curve=_curve(args), on_waiting=_say
    ) as client:
        info = client.cancel(args.job)
    print(
        f"job {args.job}: {info['state']}; {info['completed']} completed, {info['failed']} failed "
        f"(cancelled items count as failed), {info['pending']} pending",
        file=sys.stderr,
    )
    return exitcodes.OK


def _worker(args: argparse.Namespace) -> int:
    from gpu.engines.registry import make_engine
    from gpu.worker.options import WorkerOptions
    from gpu.worker.session import run_worker

    options = WorkerOptions.from_args(args, curve=_curve(args))
    engine = make_engine(options.engine, **options.engine_options)
    logging.getLogger("fabric").setLevel(logging.INFO)
    return run_worker(options, engine)


def _keys(args: argparse.Namespace) -> int:
    """`keys new NAME [--dir DIR]`: a CURVE key pair, and how to use and authorize it."""
    from pathlib import Path

    from pipeline.transport.security import new_key_pair

    public, secret = new_key_pair(args.name, Path(args.dir))
    print(f"public key: {public}")
    print(f"secret key: {secret} (mode 0600: keep it on the host that uses it)")
    print(
        f"authorize it on a broker: copy {public} into the broker's security.authorized_keys "
        f"directory (new connections see it at once; no restart)"
    )
    print(
        f"use it as a client: --key {secret} --server-key BROKER.key, or security.client_key = "
        f'"{secret}" and security.server_public_key in the config'
    )
    print(f'use it as the broker\'s own key: security.server_key = "{secret}"')
    return exitcodes.OK


def _demo(args: argparse.Namespace) -> int:
    from assembly.demo import run_demo

    return run_demo(args.dir, args.workers, args.limit)


def _prog() -> str:
    """`fabric` when run as the console script, else `run.py` (argparse's usage lines)."""
    return "fabric" if os.path.basename(sys.argv[0] or "") == "fabric" else "run.py"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only` (a command named on the command line) that one's
    alone, so that a command imports only the modules it uses (the batch, vectors and worker
    parsers come from their own modules: numpy, zmq and more, ~0.5 s of a short command)."""
    parser = argparse.ArgumentParser(prog=_prog(), description="Inference Fabric broker")
    commands = parser.add_subparsers(dest="command", required=True)
    wanted = (only,) if only in COMMANDS else COMMANDS
    if "batch" in wanted:
        from collector.oneshot import add_parser as add_batch_parser

        add_batch_parser(commands)
    if "smollm2-dir" in wanted:
        from gpu.engines.smollm2_dir import add_parser as add_smollm2_dir_parser

        add_smollm2_dir_parser(commands)
    demo = commands.add_parser("demo", help="embed the Python docs with MiniLM, end to end")
    demo.add_argument("--dir", default="var/demo", help="where the demo keeps its broker and files")
    demo.add_argument("--workers", type=int, default=1, help="local minilm worker processes")
    demo.add_argument("--limit", type=int, help="embed only the first N paragraphs")
    demo.set_defaults(handler=_demo)
    check = commands.add_parser("check", help="offline consistency check of the data dir")
    check.add_argument("--config", default="config/default.toml", help="TOML settings file")
    check.add_argument("--fix", action="store_true", help="repair what is safe to repair")
    check.set_defaults(handler=_check)
    keys = commands.add_parser("keys", help="CURVE key pairs for the broker and its clients")
    key_actions = keys.add_subparsers(dest="action", required=True)
    new = key_actions.add_parser("new", help="write NAME.key (public) and NAME.key_secret")
    new.add_argument("name", help="a name for the pair: letters, digits, '.', '_', '-'")
    new.add_argument("--dir", default="var/keys", help="where to write the pair")
    new.set_defaults(handler=_keys)

    def key_options(command) -> None:
        command.add_argument(
            "--key", help="this client's secret key file, NAME.key_secret (run.py keys new)"
        )
        command.add_argument("--server-key", help="the broker's public key file, NAME.key")

    submit = commands.add_parser(
        "submit", help="submit an OpenAI Batch JSONL file; prints the job id"
    )
    submit.add_argument("file", help="input JSONL file")
    submit.add_argument(
        "--config", default="config/default.toml", help="TOML settings file (for the address)"
    )
    submit.add_argument(
        "--broker", help="ingest address, e.g. tcp://host:7710 (overrides --config)"
    )
    submit.add_argument("--job-id", help="job id; reuse it to resume an interrupted submit")
    submit.add_argument(
        "--strict", action="store_true", help="refuse the whole file if any line is bad"
    )
    submit.add_argument("--chunk-lines", type=int, help="lines per chunk (default: the broker's)")
    submit.add_argument(
        "--deliver",
        default="file",
        help="where results go: file (results clients; the default), vectors (the vector "
        "store named after the model) or vectors:STORE (docs/vectors.md)",
    )
    submit.add_argument(
        "--deadline",
        help="when the job should be done: a duration (90s, 30m, 2h, 1d), an ISO 8601 time or "
        "seconds since the epoch; dispatch serves earlier deadlines first (a hint, never a gate)",
    )
    submit.add_argument(
        "--errors", help="where to write rejected lines (default FILE.errors.jsonl)"
    )
    submit.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer")
    submit.add_argument("--attempts", type=int, default=10, help="tries per chunk before giving up")
    key_options(submit)
    submit.set_defaults(handler=_submit)

    def client_options(command, section: str) -> None:
        command.add_argument("--config", default="config/default.toml", help="TOML settings file")
        command.add_argument("--broker", help=f"{section} address (overrides --config)")
        command.add_argument("--timeout", type=float, default=5.0, help="seconds per try")
        key_options(command)

    status = commands.add_parser("status", help="queue depth and workers, or one job's progress")
    status.add_argument("job", nargs="?", help="a job id (omit for the whole broker)")
    status.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    status.add_argument(
        "--watch", action="store_true", help="a live dashboard until Ctrl-C (JOB: only that job)"
    )
    status.add_argument(
        "--plain", action="store_true", help="with --watch: plain lines even on a terminal"
    )
    status.add_argument(
        "--interval", type=float, default=1.0, help="with --watch: seconds between refreshes"
    )
    client_options(status, "completion (with JOB) or dispatch")
    status.set_defaults(handler=_status)
    results = commands.add_parser("results", help="fetch a job's results, each exactly once")
    results.add_argument("job", help="the job id")
    results.add_argument("-o", "--output", required=True, help="output JSONL file")
    results.add_argument("--errors", help="error JSONL file (default OUT.errors.jsonl)")
    results.add_argument("--follow", action="store_true", help="keep going until the job ends")
    results.add_argument("--all", action="store_true", help="also results already delivered")
    client_options(results, "completion")
    results.set_defaults(handler=_results)
    cancel = commands.add_parser("cancel", help="cancel a job: its queued items are not run")
    cancel.add_argument("job", help="the job id")
    client_options(cancel, "completion")
    cancel.set_defaults(handler=_cancel)
    if "vectors" in wanted:
        from collector.vectors.cli import add_parser as add_vectors_parser

        add_vectors_parser(commands, client_options, _vectors)
    if "worker" in wanted:
        worker = commands.add_parser(
            "worker", help="a worker process: pulls batches, runs an engine"
        )
        from gpu.worker.options import WorkerOptions

        WorkerOptions.add_arguments(worker)
        key_options(worker)
        worker.set_defaults(handler=_worker)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_prog(), description="serve: recovery, then every stage")
    parser.add_argument("--config", required=True, help="TOML settings file")
    parser.set_defaults(handler=_serve)
    return parser


def _serving(argv: list[str]) -> bool:
    """`run.py --config FILE` serves; every other first word is a command (or help)."""
    return bool(argv) and argv[0] not in (*COMMANDS, "-h", "--help")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # numpy's BLAS on one thread in this process and every one it starts, unless set: an
    # OpenBLAS pool starts a spinning thread per core in each process (docs/operations.md).
    # Before any command imports numpy (`import run` does not).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parser = serve_parser() if _serving(argv) else build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    args.argv = argv  # how to run it again (`submit` interrupted)
    note_config(None if getattr(args, "broker", None) else getattr(args, "config", None))
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )

    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return exitcodes.CONFIG
    except DataDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.LOCKED
    except OutputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.CANNOT_WRITE
    except BrokerUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    except FabricError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.FAILED
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.OK
    except KeyboardInterrupt:  # Ctrl-C: no traceback (`batch` and `submit` say how to resume)
        print("\ninterrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _exit(code: int, argv: list[str]) -> None:
    """Exit with `code`. A broker that served has stopped every stage and written its last
    report by now: it skips the interpreter's teardown (about 0.1 s of CPU per stop, on a
    machine that may be starting the next broker), once its logs and streams are flushed."""
    if _serving(argv):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main(), sys.argv[1:])
