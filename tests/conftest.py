"""Shared fixtures: real data dirs, item batches, and the closing consistency check; how the
six test processes share the suite (`pytest_collection_modifyitems`); and the compiled
bytecode every process of the run reads (tests/bytecode.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time

# As run.py does for the broker: numpy's BLAS on one thread in each test process and every
# process it starts (an OpenBLAS pool per process costs CPU at start); before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import bytecode
import numpy as np
import pytest
import smollm2
import vllm_runs
import xdist_schedule
import zygote
from batches import KEY, LANE, SLOT_BYTES, appender, make_batch  # noqa: F401 (for the tests)

from pipeline.store.datadir import DataDir
from pipeline.transport.ports import release_ports, reserved_ports

# One SmolLM2 broker for the session (tests/smollm2.py). Defined here, once: a fixture
# bound in each test module would be one fixture per module, and one broker and worker each.
smol_broker = smollm2.smol_broker
# The same for the real vLLM runs (tests/vllm_runs.py): the skip where vLLM is missing, and the
# one broker with a vllm worker that tests/test_vllm_broker.py and tests/test_doors.py share.
vllm_host = vllm_runs.vllm_host
vllm_broker = vllm_runs.vllm_broker

FUZZ_SCALE = float(os.environ.get("FABRIC_FUZZ_SCALE", "1"))


def fuzz_examples(n: int) -> int:
    """A property test's example budget: `n` in the suite, which must stay inside its minutes
    on 2 cores; FABRIC_FUZZ_SCALE=10 pytest tests/test_wire.py (say) runs ten times as many."""
    return max(1, round(n * FUZZ_SCALE))


def assert_check_clean(data_dir: DataDir) -> None:
    """The project's own consistency check must find nothing."""
    from assembly.check import check_data_dir  # the whole top floor: child processes skip it

    report = check_data_dir(data_dir)
    assert report.clean, "\n".join(f.line() for f in report.remaining)


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        bytecode.compile_for_children()  # before the test processes start (tests/bytecode.py)
        bytecode.rewrite_tests_once(config)
        xdist_schedule.share_groups_dir()


def pytest_unconfigure(config) -> None:
    zygote.close()  # this process's (tests/zygote.py)
    if not hasattr(config, "workerinput"):
        xdist_schedule.remove_groups_dir()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return xdist_schedule.make_scheduler(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Share the suite between the pytest-xdist processes test by test
    (tests/xdist_schedule.py), the long tests first, so that no process is left alone with a
    heavy file at the end:

    - a test that uses a module-scoped fixture of its own module (a broker shared by the
      module's tests) is grouped with the module, so the fixture is made once;
    - a test marked `xdist_group` (SmolLM2's: tests/smollm2.py `needs_model`, `with_torch`) is
      in that group;
    - `slow` tests, tests that ask for a longer timeout than the default, and groups go first
      (they take seconds to a minute each), then the rest in file order, which fills the gaps;
      `--no-loadscope-reorder` keeps this order;
    - the real vLLM runs (one group) in the order of tests/vllm_runs.py `ORDER`, so that each
      vLLM engine starts once and ends after its last user."""
    first: list = []
    rest: list = []
    groups: dict[str, str] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[item.nodeid] = str(mark.args[0])
        elif _uses_a_module_fixture(item):
            groups[item.nodeid] = item.module.__name__
        heavy = item.nodeid in groups or item.get_closest_marker("slow") is not None
        heavy = heavy or _asks_for_more_time(item)
        (first if heavy else rest).append(item)
    items[:] = _vllm_runs_in_order(first + rest)
    if hasattr(config, "workerinput"):
        xdist_schedule.write_groups(config.workerinput["workerid"], groups)


def _in_vllm_group(item) -> bool:
    mark = item.get_closest_marker("xdist_group")
    return mark is not None and mark.args[0] == vllm_runs.GROUP


def _vllm_runs_in_order(items: list) -> list:
    """`items` with those of the vLLM group, in their places, sorted by their module's place in
    tests/vllm_runs.py `ORDER` (stable: each module's own order kept)."""
    places = [i for i, item in enumerate(items) if _in_vllm_group(item)]
    order = vllm_runs.ORDER
    rank = {m: r for r, m in enumerate(order)}
    runs = sorted((items[i] for i in places), key=lambda t: rank.get(t.module.__name__, len(order)))
    items = list(items)
    for place, item in zip(places, runs, strict=True):
        items[place] = item
    return items


def pytest_runtest_teardown(item, nextitem) -> None:
    """As the vLLM group's last test ends, its engines end (tests/vllm_runs.py `close_all`):
    an idle vLLM engine still takes a share of a core from the tests after it."""
    if _in_vllm_group(item) and (nextitem is None or not _in_vllm_group(nextitem)):
        vllm_runs.close_all()


def _asks_for_more_time(item) -> bool:
    """`item` is marked `timeout(N)` with N over the configured default: it says it is long."""
    mark = item.get_closest_marker("timeout")
    if mark is None or not mark.args:
        return False
    return float(mark.args[0]) > float(item.config.getini("timeout") or 0)  # pytest-timeout's


def _uses_a_module_fixture(item) -> bool:
    """`item` uses a fixture scoped to its module and defined there."""
    module = item.nodeid.split("::")[0]
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return False
    return any(
        defs[-1].scope == "module" and defs[-1].baseid == module
        for defs in fixtures.name2fixturedefs.values()
        if defs
    )


@pytest.fixture(autouse=True)
def ports_of_the_test():
    """Give back, after each test, the ports picked for it (tests/broker.py `free_ports`,
    pipeline/transport/ports.py), its brokers stopped: a fixture of the module or the session is made
    before this one, so the ports it picked stay reserved for as long as it lives."""
    before = reserved_ports()
    yield
    release_ports(reserved_ports() - before)


@pytest.fixture
def data_dir(tmp_path) -> DataDir:
    return DataDir(tmp_path / "fabric").ensure()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


FIRST_POLL_S = 0.02  # wait_for's first pause; each next one is half again as long, up to its cap


def wait_for(condition, what: str, timeout_s: float = 30.0, interval_s: float = 0.25):
    """Poll `condition` until it returns something truthy; fail after `timeout_s`.

    The pauses grow from 20 ms to `interval_s`: a condition met at once is seen at once, and
    a long wait does not ask the broker 50 times a second (a status poll costs about 5 ms of
    CPU across the test and the stages that answer it, on a suite bound by its CPU)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    pause_s = min(FIRST_POLL_S, interval_s)
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        pause.wait(pause_s)
        pause_s = min(pause_s * 1.5, interval_s)


def skip_or_fail(reason: str) -> None:
    """Skip a test that needs what this machine lacks (root, network namespaces); where the
    `CI` environment variable is set, fail it instead: CI runs as root and must run it."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, where this test must run (it runs as root)")
    pytest.skip(reason)


@contextlib.contextmanager
def small_tmpfs(path, size: str, read_only: bool = False):
    """A size-limited tmpfs mounted at `path` (a real full disk; with `read_only`, a file
    system nothing can write, root included); skips the test without root (fails it where
    `CI` is set: skip_or_fail)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        skip_or_fail(f"cannot mount a small tmpfs here ({result.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only_dir(path):
    """A directory at `path` this test process cannot write: mode 0555 for a user, a
    read-only tmpfs for root (whom modes do not stop)."""
    if os.geteuid() != 0:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with small_tmpfs(path, "1m", read_only=True) as mounted:
        yield mounted
