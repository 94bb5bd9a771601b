"""`python run.py worker --broker ADDR --model M --engine E`: a worker process of its own
(a GPU host's), with the flags of gpu/worker/options.py and the client's CURVE keys."""

from __future__ import annotations

import argparse
import logging

from cli.common import curve, key_options


def add_parser(commands) -> None:
    from gpu.worker.options import WorkerOptions  # numpy, zmq: only for this command

    worker = commands.add_parser("worker", help="a worker process: pulls batches, runs an engine")
    WorkerOptions.add_arguments(worker)
    key_options(worker)
    worker.set_defaults(handler=worker_command)


def worker_command(args: argparse.Namespace) -> int:
    from gpu.engines.registry import make_engine
    from gpu.worker.options import WorkerOptions
    from gpu.worker.session import run_worker

    options = WorkerOptions.from_args(args, curve=curve(args))
    engine = make_engine(options.engine, **options.engine_options)
    logging.getLogger("fabric").setLevel(logging.INFO)
    return run_worker(options, engine)
