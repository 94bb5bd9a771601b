"""How a person runs this program again: the command that printed hints should start with.

`python run.py ...` fails outside the virtual environment (no `python` there,
or one without the dependencies). Hints are printed with the command the
user actually ran: `fabric` (the console script, pyproject.toml) when that
is how they started it, else this interpreter and run.py, each as short as
it can be while it still works from the current directory.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

RUN_PY = Path(__file__).resolve().parents[1] / "run.py"


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
