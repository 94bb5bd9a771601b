"""How a person runs this program again: the command that printed hints should start with.

`python run.py ...` fails outside the virtual environment (no `python` there,
or one without the dependencies). Hints are printed with the command the
user actually ran: `fabric` (the console script, pyproject.toml) when that
is how they started it, else this interpreter and run.py, each as short as
it can be while it still works from the current directory. A hint to start a broker
names the config file the command was given (`note_config`), or FILE when it was given none
(a client told `--broker ADDR`).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

RUN_PY = Path(__file__).resolve().parents[2] / "run.py"  # pipeline/core/invocation.py
_config: list[str] = []  # the config file this command was given, once noted


def _short(path: Path) -> str:
    """`path` relative to the current directory when it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def how_to_run() -> str:
    """'fabric', or e.g. '.venv/bin/python run.py': ready to have a command appended."""
    if os.path.basename(sys.argv[0] or "") == "fabric":
        return "fabric"
    python = Path(sys.executable)
    return f"{shlex.quote(_short(python))} {shlex.quote(_short(RUN_PY))}"


def note_config(path: str | os.PathLike | None) -> None:
    """The config file this command reads (run.py notes it): `how_to_serve` names it."""
    _config[:] = [str(path)] if path else []


def how_to_serve() -> str:
    """The command that starts the broker this command looks for, e.g.
    '.venv/bin/python run.py --config my.toml' ('--config FILE' when no config was noted)."""
    config = shlex.quote(_config[0]) if _config else "FILE"
    return f"{how_to_run()} --config {config}"
