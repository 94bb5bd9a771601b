"""Inference Fabric: the one entry point (docs/operations.md).

python run.py --config prod.toml                   serve: recovery, then all stages; SIGTERM drains
python run.py demo                                 the real pipeline on a real model, on the CPU
python run.py submit FILE.jsonl [--config F | --broker ADDR] [--job-id ID] [--deliver vectors[:S]]
                   [--deadline 2h] [--priority N]  higher priority, then earlier deadlines first
                   [--notify [URL]]                POST the job's end there, signed (webhooks)
python run.py status [JOB] [--json]                queue depth, in-flight, workers; or one job's counts
python run.py status --watch [--plain]             a live dashboard, redrawn every second
python run.py results JOB -o OUT.jsonl [--errors ERR.jsonl] [--follow] [--all]
python run.py cancel JOB                           retire the job's queued items as cancelled
python run.py pause JOB | resume JOB               hold a job's queued items back, or let them go
python run.py priority JOB N                       change a running job's priority (higher first)
python run.py vectors stats|search|export          the vector store (docs/vectors.md)
python run.py worker --broker ADDR --model M --engine E   a GPU (or CPU) worker process
python run.py fleet --ray ADDRESS --config F       workers as Ray actors, sized by the broker's demand
python run.py check --config prod.toml [--fix]     offline consistency check of the data dir
python run.py batch IN.jsonl -o OUT.jsonl [--config F | --model M --engine E]   one-shot, resumable
python run.py keys new NAME [--dir DIR]            a CURVE key pair (docs/operations.md)
python run.py smollm2-dir DIR                      SmolLM2 as a model directory for the vllm engine

Client commands and `worker` take `--key NAME.key_secret` and `--server-key BROKER.key`
for a broker that requires CURVE keys (else `[security]` in --config).

Each command is a module of cli/ (serving: cli/serve.py): it adds its parser and runs it.
Here are the table of commands, the dispatch, and what every command's errors exit with.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from cli.common import prog
from cli.serve import serve_parser
from pipeline.core import exitcodes
from pipeline.core.errors import (
    BrokerUnavailableError,
    ConfigError,
    DataDirLockedError,
    FabricError,
    OutputError,
)
from pipeline.core.invocation import note_config

# The commands, in the order `--help` lists them: each is the module cli/<command>.py.
COMMANDS: tuple[str, ...] = ("batch", "demo", "check", "keys", "submit", "status", "results")
COMMANDS += ("cancel", "pause", "resume", "priority", "vectors", "worker", "fleet", "smollm2-dir")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only` (a command named on the command line) that one's
    alone, so that a command imports only the modules it uses (the batch, vectors and worker
    modules import numpy, zmq and more: ~0.5 s of a short command)."""
    parser = argparse.ArgumentParser(prog=prog(), description="Inference Fabric broker")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in (only,) if only in COMMANDS else COMMANDS:
        importlib.import_module(f"cli.{name.replace('-', '_')}").add_parser(commands)
    return parser


def _serving(argv: list[str]) -> bool:
    """`run.py --config FILE` serves; every other first word is a command (or help)."""
    return bool(argv) and argv[0] not in (*COMMANDS, "-h", "--help")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line after the program's name, as `main` reads it (a bad one exits 2):
    also what checks the commands deploy/ runs (tests/test_deploy_manifests.py)."""
    parser = serve_parser() if _serving(argv) else build_parser(argv[0] if argv else None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # numpy's BLAS on one thread in this process and every one it starts, unless set: an
    # OpenBLAS pool starts a spinning thread per core in each process (docs/operations.md).
    # Before any command imports numpy (`import run` does not).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = parse_args(argv)
    args.argv = argv  # how to run it again (`submit` interrupted)
    note_config(None if getattr(args, "broker", None) else getattr(args, "config", None))
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
    except OutputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.CANNOT_WRITE
    except BrokerUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    except FabricError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.FAILED
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.OK
    except KeyboardInterrupt:  # Ctrl-C: no traceback (`batch` and `submit` say how to resume)
        print("\ninterrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _exit(code: int, argv: list[str]) -> None:
    """Exit with `code`. A broker that served has stopped every stage and written its last
    report by now: it skips the interpreter's teardown (about 0.1 s of CPU per stop, on a
    machine that may be starting the next broker), once its logs and streams are flushed."""
    if _serving(argv):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main(), sys.argv[1:])
