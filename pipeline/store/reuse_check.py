"""`run.py check` of the reuse index (pipeline/store/reuse_store.py): every entry read back.

| code                 | what |
|----------------------|------|
| `reuse-table-damaged`| `reuse/table.bin` is not a reuse table (bad magic or size) |
| `reuse-entry-damaged`| a used slot fails its check word, or its record is gone, torn, or holds another key |

A damaged entry is never reused (lookups skip a slot that fails its check, and
completion checks the record's key and CRC before storing it), so the broker
runs on; the finding says what was lost: results that will be computed again.
`--fix` rebuilds the table without the damaged entries.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.store.check import Finding
from pipeline.store.reuse_store import read_results, reuse_dir
from pipeline.store.reuse_table import TABLE_FILE, ReuseTable, TableError, rebuild, slot_checks

MAX_LISTED = 10


def check_reuse(data_root: Path, fix: bool = False) -> tuple[list[Finding], list[str]]:
    """Findings about the reuse index of `data_root`, and what `fix` did."""
    path = reuse_dir(data_root) / TABLE_FILE
    if not path.exists():
        return [], []
    try:
        table = ReuseTable(path, writable=False)
    except (TableError, OSError) as exc:
        return [Finding(path, "reuse-table-damaged", f"{exc}; the broker starts a new one")], []
    try:
        used = table.slots[table.slots["file"] != 0].copy()
        capacity = table.capacity
    finally:
        table.close()
    bad = slot_checks(used) != used["check"]
    sound = np.flatnonzero(~bad)
    keys = np.stack([used["k0"][sound], used["k1"][sound]], axis=1)
    where = np.stack(
        [used["file"][sound], used["offset"][sound], used["length"][sound]], axis=1
    ).astype(np.uint64)
    for start in range(0, len(sound), 65536):  # bounded memory: records read a block at a time
        stop = start + 65536
        results = read_results(data_root, keys[start:stop], where[start:stop])
        gone = np.array([r is None for r in results], bool)
        bad[sound[start:stop][gone]] = True
    if not bad.any():
        return [], []
    damaged = used[bad]
    listed = ", ".join(
        f"slot key {int(k0):016x}{int(k1):016x} -> data-{int(f):08d} @ {int(o)}"
        for k0, k1, f, o in zip(
            damaged["k0"][:MAX_LISTED],
            damaged["k1"][:MAX_LISTED],
            damaged["file"][:MAX_LISTED],
            damaged["offset"][:MAX_LISTED],
            strict=True,
        )
    )
    finding = Finding(
        path,
        "reuse-entry-damaged",
        f"{len(damaged)} of {len(used)} entries fail their check or point at a missing or "
        f"damaged record ({listed}); they are never reused (their requests run again); "
        "`run.py check --fix` drops them",
        fixable=True,
    )
    fixed = []
    if fix:
        rebuild(path, used[~bad], capacity)
        fixed.append(f"{path}: reuse table rebuilt without {len(damaged)} damaged entries")
    return [finding], fixed
