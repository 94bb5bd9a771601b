"""`python run.py results JOB -o OUT.jsonl`: a job's results, each delivered once (with
`--all` again), into OUT and its errors file; `--follow` until the job ends."""

from __future__ import annotations

import argparse
import sys

from cli.common import address, client_options, curve, decoders, say
from pipeline.core import exitcodes


def add_parser(commands) -> None:
    results = commands.add_parser("results", help="fetch a job's results, each exactly once")
    results.add_argument("job", help="the job id")
    results.add_argument("-o", "--output", required=True, help="output JSONL file")
    results.add_argument("--errors", help="error JSONL file (default OUT.errors.jsonl)")
    results.add_argument("--follow", action="store_true", help="keep going until the job ends")
    results.add_argument("--all", action="store_true", help="also results already delivered")
    client_options(results, "completion")
    results.set_defaults(handler=results_command)


def results_command(args: argparse.Namespace) -> int:
    from cli.progress_line import ProgressLine
    from collector.delivery.heap import keep_freed_memory
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
            address(args, "completion"), args.timeout, curve=curve(args), on_waiting=say
        ) as client,
        line,  # ends a line redrawn in place, whatever happens
    ):
        report = client.fetch(
            args.job,
            args.output,
            err_path,
            follow=args.follow,
            everything=args.all,
            decoders=decoders(args),
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
