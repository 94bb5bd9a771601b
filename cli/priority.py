"""`python run.py priority JOB N`: change a running job's priority (higher first)."""

from __future__ import annotations

import argparse

from cli.common import client_options
from cli.pause import control_command


def add_parser(commands) -> None:
    priority = commands.add_parser(
        "priority", help="change a job's priority: an integer, higher first (default 0)"
    )
    priority.add_argument("job", help="the job id")
    priority.add_argument("priority", type=int, help="the new priority")
    client_options(priority, "completion")
    priority.set_defaults(handler=priority_command)


def priority_command(args: argparse.Namespace) -> int:
    args.change = {"priority": args.priority}
    return control_command(args)
