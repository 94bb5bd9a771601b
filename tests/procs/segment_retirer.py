"""A completion-like process for crash tests: retires acknowledged slots it is told of.

    python segment_retirer.py DATA_DIR SEED

Reads `SEGMENT SLOT` lines on stdin; now and then retires a random half of
what it has read, syncs, and only then prints `dead SEGMENT SLOT` for each.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment


def main() -> None:
    data_dir = DataDir(sys.argv[1])
    rng = np.random.default_rng(int(sys.argv[2]))
    paths = {}
    pending: dict[int, list[int]] = defaultdict(list)
    for line_no, line in enumerate(sys.stdin):
        segment_id, slot = map(int, line.split())
        pending[segment_id].append(slot)
        if line_no % 50:
            continue
        if not paths or segment_id not in paths:
            paths = {int(p.name.split("-")[1].split(".")[0]): p for p in data_dir.segment_files()}
        done = []
        for seg_id, slots in pending.items():
            chosen = np.array(slots)[rng.random(len(slots)) < 0.5]
            with Segment.open(paths[seg_id], writable=True) as seg:
                seg.tombstone(chosen)
                seg.sync()
            done.extend((seg_id, int(s)) for s in chosen)
        pending.clear()
        sys.stdout.write("".join(f"dead {a} {b}\n" for a, b in done))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
