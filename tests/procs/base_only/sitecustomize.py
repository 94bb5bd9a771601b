"""On PYTHONPATH, makes the modules named in FABRIC_BLOCKED_IMPORTS unimportable.

tests/test_demo.py puts this directory first on the demo's PYTHONPATH with the test extras'
modules named, so the demo (and every process it starts) shows it runs on the base
dependencies alone, as the README's `pip install -e .` gives them.
"""

import os
import sys

BLOCKED = frozenset(filter(None, os.environ.get("FABRIC_BLOCKED_IMPORTS", "").split(",")))


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not a base dependency (blocked for this test)")
        return None


if BLOCKED:
    sys.meta_path.insert(0, _Blocker())
