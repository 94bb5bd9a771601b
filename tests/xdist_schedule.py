"""How the pytest-xdist processes share the suite: test by test, with a few groups kept whole.

pytest-xdist's own `--dist loadgroup` does not group under pytest 9 (it renames node ids
through an attribute pytest 9 no longer reads), and `--dist loadfile` leaves one process
alone with a heavy file at the end. So the scheduler is ours (`pytest_xdist_make_scheduler`
in tests/conftest.py):

| step | who | what |
|------|-----|------|
| 1 | controller, `pytest_configure` | makes a directory and names it in `FABRIC_TEST_GROUPS` (the workers inherit it) |
| 2 | each worker, after collection | writes `{node id: group}` there (`write_groups`): the tests that must share a process |
| 3 | controller, `GroupScheduling` | hands out one unit per group and one per other test, in collection order (slow ones first: conftest) |
| 4 | controller, `pytest_unconfigure` | removes the directory |

A group is the module's name for a test that uses a module-scoped fixture of its own module
(a broker shared by the module's tests: made once), or the name of its `xdist_group` mark
(SmolLM2's tests: one process loads the model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

GROUPS_ENV = "FABRIC_TEST_GROUPS"


def share_groups_dir() -> None:
    """In the controller: a directory for the workers' group lists, named in the environment."""
    if GROUPS_ENV not in os.environ:
        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="fabric-test-groups-")


def remove_groups_dir() -> None:
    """In the controller, at the end: the directory `share_groups_dir` made."""
    directory = os.environ.pop(GROUPS_ENV, None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def write_groups(worker: str, groups: dict[str, str]) -> None:
    """In a worker: its `{node id: group}` for the controller (written whole, then renamed)."""
    directory = os.environ.get(GROUPS_ENV)
    if not directory:
        return
    target = Path(directory) / f"{worker}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    partial.rename(target)


def make_scheduler(config, log):
    """A LoadScopeScheduling whose scope of a test is its group, or the test itself."""
    from xdist.scheduler.loadscope import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = _read_groups()
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def _read_groups() -> dict[str, str]:
    """The first worker's list (every worker collects the same tests); empty when none wrote."""
    directory = os.environ.get(GROUPS_ENV)
    written = sorted(Path(directory).glob("*.json")) if directory else []
    return json.loads(written[0].read_text()) if written else {}
