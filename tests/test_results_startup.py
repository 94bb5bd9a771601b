"""`run.py results` imports only what it uses; `run.py --help` still lists every command.

run.py builds only the parser of the command named on its command line
(`build_parser(only)`): the batch, vectors and worker parsers live in their own
modules, whose imports cost a short command like `results` about 0.3 s of CPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import run

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("cli.batch", "cli.vectors", "gpu.worker.options")


def test_results_parser_leaves_other_commands_modules_unimported():
    probe = (
        "import sys, run; "
        "args = run.build_parser('results').parse_args(['results', 'JOB', '-o', 'OUT']); "
        f"print(args.handler.__module__, [m for m in {HEAVY!r} if m in sys.modules])"
    )
    answer = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert answer.stdout.split() == ["cli.results", "[]"]


def test_help_lists_every_command():
    commands = next(a for a in run.build_parser()._actions if getattr(a, "choices", None))
    assert set(commands.choices) == set(run.COMMANDS)


def test_each_command_alone_parses_as_with_every_parser():
    for argv in (
        ["worker", "--broker", "tcp://h:1", "--model", "m", "--engine", "echo"],
        ["batch", "in.jsonl", "-o", "out.jsonl"],
        ["vectors", "stats"],
    ):
        alone = run.build_parser(argv[0]).parse_args(argv)
        every = run.build_parser().parse_args(argv)
        assert vars(alone) == vars(every)
