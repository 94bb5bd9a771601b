"""`python run.py check --config FILE [--fix]`: the offline consistency check of a data dir
(assembly/check.py), said line by line; exit 1 while findings remain."""

from __future__ import annotations

import argparse

from config import load_settings
from pipeline.core import exitcodes


def add_parser(commands) -> None:
    check = commands.add_parser("check", help="offline consistency check of the data dir")
    check.add_argument("--config", default="config/default.toml", help="TOML settings file")
    check.add_argument("--fix", action="store_true", help="repair what is safe to repair")
    check.set_defaults(handler=check_command)


def check_command(args: argparse.Namespace) -> int:
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
