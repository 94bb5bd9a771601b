"""Inference Fabric: the one entry point (DESIGN.md section 6).

python run.py check --config prod.toml [--fix]    offline consistency check of the data dir
"""

from __future__ import annotations

import argparse
import logging
import sys

from config import load_settings
from pipeline import exitcodes
from pipeline.errors import ConfigError, DataDirLockedError


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run.py", description="Inference Fabric broker")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="offline consistency check of the data dir")
    check.add_argument("--config", default="config/default.toml", help="TOML settings file")
    check.add_argument("--fix", action="store_true", help="repair what is safe to repair")
    check.set_defaults(handler=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
