"""Every Python process of the suite reads the project's compiled bytecode.

A machine whose environment sets PYTHONDONTWRITEBYTECODE (as some containers
do) makes every interpreter compile the project's sources again: about 0.3 s
of CPU for each test process, broker supervisor, stage fork server, worker and
client command, hundreds of times over a run. The controller
(`pytest_configure` in tests/conftest.py) compiles the sources once into the
usual `__pycache__` folders (ignored by git) and lets its children read and
write them: the test processes, and through them every broker they start,
inherit its environment.
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "config", "router", "ingest", "gpu", "collector", "api", "assembly")


def compile_for_children() -> None:
    """Compile the project once (quietly; a folder that cannot be written is left as it is)
    and let this process's children use bytecode."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    for name in PACKAGES:
        compileall.compile_dir(REPO / name, quiet=2)
    compileall.compile_file(REPO / "run.py", quiet=2)
