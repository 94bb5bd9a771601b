"""A writer process for vector shard crash tests: appends and flushes forever.

    python vector_writer.py SHARD_DIR SEED

Opens (recovers) shard 0, then loops: one to three appends of rows made by
`expected_rows`, one flush, and prints `ack FIRST COUNT` only after the flush
made them durable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from collector.vectors.shard import Shard

ID_BASE = 10**12


def expected_rows(first: int, count: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids and float32 rows that belong at rows `first .. first+count-1`."""
    rows = np.arange(first, first + count, dtype=np.uint64)
    values = (rows[:, None] * dim + np.arange(dim, dtype=np.uint64)) % 65521
    return rows + ID_BASE, (values.astype(np.float32) / 8).astype(np.float32)


def main() -> None:
    shard = Shard.open(Path(sys.argv[1]), 0)
    rng = np.random.default_rng(int(sys.argv[2]))
    out = sys.stdout
    while True:
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 200))
            shard.append(*expected_rows(shard.rows + shard.pending_rows, n, shard.dim))
        first, count = shard.flush()
        out.write(f"ack {first} {count}\n")
        out.flush()


if __name__ == "__main__":
    main()
