"""`python run.py submit FILE.jsonl`: an OpenAI Batch file into a running broker, chunk by
durable chunk; prints the job id. Interrupted, it says the command that resumes it."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from cli.common import curve, key_options, limit_options, limits_of, say
from config import load_settings
from config.settings import ApiSettings
from pipeline.core import exitcodes
from pipeline.core.errors import BrokerUnavailableError
from pipeline.core.invocation import how_to_run


def add_parser(commands) -> None:
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
        "seconds since the epoch; the broker says whether the job is on track or at risk, and "
        "dispatch serves the least slack first (a hint, never a gate)",
    )
    submit.add_argument(
        "--deadline-strict",
        action="store_true",
        help="with --deadline: refuse the job, storing nothing, when the broker projects it "
        "would finish after its deadline with the workers there are (exit code 11)",
    )
    submit.add_argument(
        "--dispatch",
        help="dispatch's address, for the deadline projection (default: the config's)",
    )
    submit.add_argument(
        "--priority",
        type=int,
        default=0,
        help="the job's priority, an integer: dispatch serves higher first (default 0; lower "
        "priorities keep a minimum share, docs/dispatch.md); change it with `priority JOB N`",
    )
    submit.add_argument(
        "--errors", help="where to write rejected lines (default FILE.errors.jsonl)"
    )
    submit.add_argument(
        "--notify",
        nargs="?",
        const="",
        metavar="URL",
        help="POST the job's end there, signed (OpenAI's batch event; docs/operations.md, "
        'Webhooks); alone: the url of the [[api.webhooks]] table of owner "cli", whose '
        "secret signs it in any case",
    )
    submit.add_argument(
        "--reuse",
        action="store_true",
        help="lines identical to an earlier deterministic request take its stored result "
        "instead of running (docs/completion.md, Result reuse)",
    )
    submit.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer")
    submit.add_argument("--attempts", type=int, default=10, help="tries per chunk before giving up")
    limit_options(submit)
    key_options(submit)
    submit.set_defaults(handler=submit_command)


def submit_command(args: argparse.Namespace) -> int:
    import orjson

    from cli.progress_line import ProgressLine
    from ingest.deadline_text import parse_deadline
    from ingest.submit_client import Producer, new_job_id
    from pipeline.core.job_limits import LimitError

    try:
        limits = limits_of(args)
    except LimitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    deadline = parse_deadline(args.deadline, time.time()) if args.deadline else None
    if args.deadline_strict and deadline is None:
        print("error: --deadline-strict needs a --deadline", file=sys.stderr)
        return exitcodes.USAGE
    settings = load_settings(args.config)
    if deadline is not None:
        refused = deadline_answer(args, settings, deadline)
        if refused is not None:
            return refused
    address = args.broker or settings.ingest.bind
    notify = "" if args.notify is None else notify_url(args.notify, settings.api)
    if notify is None:
        return exitcodes.USAGE
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
            address, args.timeout, attempts=args.attempts, curve=curve(args), on_waiting=say
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
                job_priority=args.priority,
                notify=notify,
                limits=limits,
                reuse=args.reuse,
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


def deadline_answer(args: argparse.Namespace, settings, deadline: float) -> int | None:
    """Say whether the job is on track for `deadline` (gpu/dispatch/promise.py); the exit code
    when --deadline-strict refuses it (at risk, or no answer to check with), else None."""
    from collector.results_client import DispatchClient
    from gpu.dispatch.promise import lines_per_model, promise
    from pipeline.core.errors import FabricError
    from pipeline.transport.topology import client_address

    where = args.dispatch or client_address(settings.dispatch.bind)
    try:
        with DispatchClient(where, min(args.timeout, 5.0), 1, curve(args)) as client:
            info = client.broker_status()
    except FabricError as exc:
        print(
            f"deadline: no projection: dispatch at {where} did not answer ({exc})",
            file=sys.stderr,
        )
        if args.deadline_strict:
            print(
                "refused (--deadline-strict): the deadline cannot be checked; nothing stored",
                file=sys.stderr,
            )
            return exitcodes.UNAVAILABLE
        return None
    counts = lines_per_model(args.file, settings.models)
    answer = promise(info, counts, deadline, args.priority)
    if answer.at_risk and args.deadline_strict:
        print(
            f"refused (--deadline-strict): {answer.words}; nothing stored. Add workers, move "
            "the deadline, or submit without --deadline-strict",
            file=sys.stderr,
        )
        return exitcodes.DEADLINE_AT_RISK
    print(f"deadline: {answer.words}", file=sys.stderr)
    return None


def notify_url(given: str, api: ApiSettings) -> str | None:
    """The URL of `--notify` (its table's when none is given); None after saying why not."""
    from collector.completion.job_webhooks import CLI_OWNER
    from collector.webhooks import url_problem

    table = next((t for t in api.webhooks if t.owner == CLI_OWNER), None)
    if table is None:
        say(
            f'error: --notify needs an [[api.webhooks]] table with owner = "{CLI_OWNER}" in the '
            "configuration (its secret_file signs the event; docs/operations.md, Webhooks)"
        )
        return None
    url = given or table.url
    problem = url_problem(url, api.webhook_hosts)
    if problem:
        say(f"error: --notify {url!r} {problem}")
        return None
    return url
