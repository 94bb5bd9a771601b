"""`python run.py resume JOB`: a paused job's queued items are dispatched again."""

from __future__ import annotations

from cli.common import client_options
from cli.pause import control_command


def add_parser(commands) -> None:
    resume = commands.add_parser("resume", help="resume a paused job")
    resume.add_argument("job", help="the job id")
    client_options(resume, "completion")
    resume.set_defaults(handler=control_command, change={"paused": False})
