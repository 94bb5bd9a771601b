"""Inference Fabric: the one entry point (DESIGN.md section 6).

python run.py --config prod.toml                   serve: recovery, then all stages; SIGTERM drains
python run.py submit FILE.jsonl [--config F | --broker ADDR] [--job-id ID] [--strict]
python run.py check --config prod.toml [--fix]     offline consistency check of the data dir
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from config import load_settings
from pipeline import exitcodes
from pipeline.errors import ConfigError, DataDirLockedError, FabricError

COMMANDS = ("check", "submit")


def _serve(args: argparse.Namespace) -> int:
    from pipeline.supervisor import Supervisor
    from pipeline.topology import ring_specs, stage_specs

    settings = load_settings(args.config)
    supervisor = Supervisor(settings, stage_specs(settings), ring_specs(settings))
    print(
        f"fabric: serving {settings.data_path} (logs in {settings.data_path / 'log'})",
        file=sys.stderr,
    )
    return supervisor.run()


def _check(args: argparse.Namespace) -> int:
    from pipeline.check import check_data_dir
    from pipeline.datadir import DataDir

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
    if report.clean:
        print(f"clean: {report.segments} segment file(s) in {data_dir.root}")
        return exitcodes.OK
    fixable = sum(f.fixable for f in report.remaining)
    hint = f"; {fixable} can be repaired with --fix" if fixable else ""
    print(f"{len(report.remaining)} finding(s) in {data_dir.root}{hint}")
    return exitcodes.FINDINGS


class _ProgressLine:
    """A progress line on stderr: redrawn in place on a terminal, a line every 2 s otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.started = self.last = time.monotonic()

    def __call__(self, report, lines_done: int) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 2.0:
            return
        self.last = now
        rate = lines_done / max(1e-9, now - self.started)
        text = f"submit {report.job_id}: {lines_done} lines read, {report.stored} items durable, {report.rejected} rejected, {rate:,.0f} lines/s"
        print(
            ("\r" + text) if self.tty else text,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )


def _submit(args: argparse.Namespace) -> int:
    import orjson

    from ingest.sdk import BrokerUnavailableError, Producer

    address = args.broker or load_settings(args.config).ingest.bind
    progress = _ProgressLine()
    with Producer(address, timeout_s=args.timeout, attempts=args.attempts) as producer:
        try:
            report = producer.submit_file(
                args.file,
                args.job_id,
                chunk_lines=args.chunk_lines,
                strict=args.strict,
                progress=progress,
            )
        except BrokerUnavailableError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return exitcodes.UNAVAILABLE
    if progress.tty:
        print(file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run.py", description="Inference Fabric broker")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="offline consistency check of the data dir")
    check.add_argument("--config", default="config/default.toml", help="TOML settings file")
    check.add_argument("--fix", action="store_true", help="repair what is safe to repair")
    check.set_defaults(handler=_check)
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
        "--errors", help="where to write rejected lines (default FILE.errors.jsonl)"
    )
    submit.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer")
    submit.add_argument("--attempts", type=int, default=10, help="tries per chunk before giving up")
    submit.set_defaults(handler=_submit)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run.py", description="serve: recovery, then every stage")
    parser.add_argument("--config", required=True, help="TOML settings file")
    parser.set_defaults(handler=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serving = bool(argv) and argv[0] not in (*COMMANDS, "-h", "--help")
    args = (serve_parser() if serving else build_parser()).parse_args(argv)
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
    except FabricError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.FAILED


if __name__ == "__main__":
    sys.exit(main())
