"""What the client commands share: their options (`--config`, `--broker`, `--timeout`, the
CURVE keys), the broker address and keys those options name, and how a client's news is said.
"""

from __future__ import annotations

import argparse
import os
import sys

from config import load_settings
from config.defaults import DEFAULTS


def prog() -> str:
    """`fabric` when run as the console script, else `run.py` (argparse's usage lines)."""
    return "fabric" if os.path.basename(sys.argv[0] or "") == "fabric" else "run.py"


def key_options(command: argparse.ArgumentParser) -> None:
    """`--key` / `--server-key`: a client's CURVE keys (docs/operations.md)."""
    command.add_argument(
        "--key", help="this client's secret key file, NAME.key_secret (run.py keys new)"
    )
    command.add_argument("--server-key", help="the broker's public key file, NAME.key")


def client_options(command: argparse.ArgumentParser, section: str) -> None:
    """The options of a command that asks a running broker: where it is, how long to wait."""
    command.add_argument("--config", default="config/default.toml", help="TOML settings file")
    command.add_argument("--broker", help=f"{section} address (overrides --config)")
    command.add_argument("--timeout", type=float, default=5.0, help="seconds per try")
    key_options(command)


def say(line: str) -> None:
    """A client's news for the person waiting on it ("waiting for the broker at ADDR")."""
    print(f"{line} ...", file=sys.stderr, flush=True)


def address(args: argparse.Namespace, section: str) -> str:
    """The broker address a client command uses: --broker, else the config's (as a client)."""
    from pipeline.transport.topology import client_address

    if getattr(args, "broker", None):
        return args.broker
    return client_address(getattr(load_settings(args.config), section).bind)


def curve(args: argparse.Namespace):
    """This client's CURVE keys: --key / --server-key over the config's [security], or None.

    The config is read only when it exists, so `--broker ADDR --key K --server-key S`
    works on a host without one.
    """
    from config.settings import SecuritySettings
    from pipeline.transport.security import client_curve

    config = getattr(args, "config", None)
    if config and (os.path.exists(config) or not getattr(args, "broker", None)):
        security = load_settings(config).security
    else:
        security = SecuritySettings(**DEFAULTS["security"])
    return client_curve(security, args.key, args.server_key)


def decoders(args: argparse.Namespace) -> dict:
    """The decoders of the configured models, to render generated text (where their
    tokenizers are on this host); none with --broker or without the config file."""
    from collector.delivery.decoders import model_decoders

    if getattr(args, "broker", None) or not os.path.exists(args.config):
        return {}
    return model_decoders(load_settings(args.config))


def limit_options(command: argparse.ArgumentParser) -> None:
    """A job's caps (pipeline/core/job_limits.py; docs/operations.md, "Error and budget caps")."""
    command.add_argument(
        "--max-error-rate",
        metavar="R",
        help="stop the job (error_cap) when more than this share (0..1) of its lines failed, "
        "once --min-sample lines are done",
    )
    command.add_argument(
        "--min-sample",
        metavar="N",
        help="lines done before --max-error-rate may stop the job (default 20)",
    )
    command.add_argument(
        "--max-errors", metavar="N", help="stop the job (error_cap) when more than N lines failed"
    )
    command.add_argument(
        "--max-tokens-budget",
        metavar="N",
        help="stop the job (budget_exceeded) when its prompt + generated tokens reach N",
    )
    command.add_argument(
        "--max-worker-seconds",
        metavar="S",
        help="stop the job (budget_exceeded) when its results took S seconds of engine time",
    )


def limits_of(args: argparse.Namespace) -> dict:
    """The caps `limit_options` gave, as a job record keeps them ({} for none); LimitError
    names a bad flag."""
    from pipeline.core.job_limits import limits_of_flags

    values = {
        "max_error_rate": args.max_error_rate,
        "min_sample": args.min_sample,
        "max_errors": args.max_errors,
        "max_tokens": args.max_tokens_budget,
        "max_worker_s": args.max_worker_seconds,
    }
    return limits_of_flags(values).to_record()
