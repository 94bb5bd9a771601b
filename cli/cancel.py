"""`python run.py cancel JOB`: retire the job's queued items as cancelled."""

from __future__ import annotations

import argparse
import sys

from cli.common import address, client_options, curve, say
from pipeline.core import exitcodes


def add_parser(commands) -> None:
    cancel = commands.add_parser("cancel", help="cancel a job: its queued items are not run")
    cancel.add_argument("job", help="the job id")
    client_options(cancel, "completion")
    cancel.set_defaults(handler=cancel_command)


def cancel_command(args: argparse.Namespace) -> int:
    from collector.results_client import ResultsClient

    with ResultsClient(
        address(args, "completion"), timeout_s=args.timeout, curve=curve(args), on_waiting=say
    ) as client:
        info = client.cancel(args.job)
    print(
        f"job {args.job}: {info['state']}; {info['completed']} completed, {info['failed']} failed "
        f"(cancelled items count as failed), {info['pending']} pending",
        file=sys.stderr,
    )
    return exitcodes.OK
