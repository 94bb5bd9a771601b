"""`python run.py pause JOB` / `resume JOB`: hold a job's queued items back, or let them go."""

from __future__ import annotations

import argparse
import sys

from cli.common import address, client_options, curve, say
from pipeline.core import exitcodes


def add_parser(commands) -> None:
    pause = commands.add_parser(
        "pause", help="pause a job: its queued items wait (items in flight finish)"
    )
    pause.add_argument("job", help="the job id")
    client_options(pause, "completion")
    pause.set_defaults(handler=control_command, change={"paused": True})


def control_command(args: argparse.Namespace) -> int:
    """Send the change in `args.change` (pause, resume or priority) and say the job's state."""
    from collector.results_client import ResultsClient

    with ResultsClient(
        address(args, "completion"), timeout_s=args.timeout, curve=curve(args), on_waiting=say
    ) as client:
        info = client.control(args.job, **args.change)
    paused = "paused" if info.get("paused") else "not paused"
    print(
        f"job {args.job}: {info['state']}, {paused}, priority {info.get('priority', 0)}; "
        f"{info['completed']} completed, {info['failed']} failed, {info['pending']} pending",
        file=sys.stderr,
    )
    return exitcodes.OK
