"""Every Python process of the suite reads the project's compiled bytecode.

A machine whose environment sets PYTHONDONTWRITEBYTECODE (as some containers
do) makes every interpreter compile the project's sources again: about 0.3 s
of CPU for each test process, broker supervisor, stage fork server, worker and
client command, hundreds of times over a run. The controller
(`pytest_configure` in tests/conftest.py) compiles the sources once into the
usual `__pycache__` folders (ignored by git) and lets its children read and
write them: the test processes, and through them every broker they start,
inherit its environment.

The test modules are compiled apart: pytest rewrites their asserts and caches
the result in its own `__pycache__/*-pytest-*.pyc`. From a fresh clone the six
test processes would each rewrite all of them at collection, at once (about 5 s
of CPU each); `rewrite_tests_once` has the controller write those files first,
with pytest's own functions, so that every process reads them.
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


def rewrite_tests_once(config) -> None:
    """Write pytest's assert-rewritten bytecode of conftest.py and every test module that has
    none up to date. pytest's rewrite functions are internal: where they moved, nothing is
    done here and each process rewrites for itself, as without this."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
            try_makedirs,
        )
    except ImportError:
        return
    state = config.stash.get(assertstate_key, None)
    if state is None or sys.dont_write_bytecode:  # asserts not rewritten (--assert=plain)
        return
    tests = REPO / "tests"
    for path in [tests / "conftest.py", *sorted(tests.glob("test_*.py"))]:
        cache = get_cache_dir(path)
        if not try_makedirs(cache):
            return
        pyc = cache / (path.name[:-3] + PYC_TAIL)
        if _read_pyc(path, pyc) is None:
            stamp, code = _rewrite_test(path, config)
            _write_pyc(state, code, stamp, pyc)
