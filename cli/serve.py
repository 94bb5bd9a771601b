"""`python run.py --config FILE`: serve, the broker itself (recovery, then every stage;
SIGTERM drains). Not a subcommand: every other first word is one (run.py)."""

from __future__ import annotations

import argparse

from cli.common import prog
from config import load_settings


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog(), description="serve: recovery, then every stage")
    parser.add_argument("--config", required=True, help="TOML settings file")
    parser.set_defaults(handler=serve_command)
    return parser


def serve_command(args: argparse.Namespace) -> int:
    from assembly.broker import broker_supervisor

    settings = load_settings(args.config)
    return broker_supervisor(settings).run()  # says "serving" once its pre-start checks passed
