"""`python run.py status [JOB] [--json]`: the broker's queue, in-flight work and workers, or
one job's counts; `--watch`: the live dashboard (collector/status_watch.py) until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys

from cli.common import address, client_options, curve, say
from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.errors import FabricError


def add_parser(commands) -> None:
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
    status.set_defaults(handler=status_command)


def status_command(args: argparse.Namespace) -> int:
    import orjson

    from collector.job_state import with_in_flight
    from collector.results_client import DispatchClient, ResultsClient

    if args.watch:
        return _watch(args)
    keys = curve(args)
    if args.job:
        completion = address(args, "completion")
        with ResultsClient(completion, args.timeout, curve=keys, on_waiting=say) as client:
            info = client.job_status(args.job)
        info = with_in_flight(info, _dispatch_status(args, keys))
    else:
        dispatch = address(args, "dispatch")
        with DispatchClient(dispatch, args.timeout, curve=keys, on_waiting=say) as client:
            info = client.broker_status()
    if args.json:
        print(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode())
        return exitcodes.OK
    from collector.status_view import render_broker, render_job

    print(render_job(info) if args.job else render_broker(info))
    return exitcodes.OK


def _dispatch_status(args: argparse.Namespace, keys) -> dict | None:
    """Dispatch's BROKER_INFO (which items are with workers), or None: it is only a detail of
    `status JOB`, and a --broker address there is completion's, not dispatch's."""
    from collector.results_client import DispatchClient

    if args.broker:
        return None
    try:
        with DispatchClient(address(args, "dispatch"), args.timeout, 1, keys) as client:
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
    keys = curve(args)
    if args.broker:  # maybe another host: only what dispatch says
        sources = Sources(args.broker, None, None, args.timeout, only_job=args.job, curve=keys)
    else:
        settings = load_settings(args.config)
        sources = Sources(
            client_address(settings.dispatch.bind),
            client_address(settings.completion.bind),
            settings.data_path,
            args.timeout,
            only_job=args.job,
            curve=keys,
        )
    plain = args.plain or not sys.stdout.isatty() or os.environ.get("TERM") == "dumb"
    return watch(sources, sources.dispatch_address, args.interval, plain)
