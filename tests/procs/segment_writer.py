"""A writer process for crash tests: appends batches forever, prints each ack after sync.

    python segment_writer.py DATA_DIR SEQ0 SEED

Each acknowledged batch prints `ack SEGMENT FIRST COUNT SEQ` (one line per
placement) only after the fdatasync that made it durable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batches import appender, make_batch

from pipeline.store.datadir import DataDir


def main() -> None:
    data_dir = DataDir(sys.argv[1])
    seq = int(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    log = appender(data_dir, segment_bytes=1 << 17)
    out = sys.stdout
    while True:
        n = int(rng.integers(1, 300))
        placed = log.append(*make_batch(rng, n, seq))
        log.sync()
        start = seq
        for segment, first, count in placed.tolist():
            out.write(f"ack {segment} {first} {count} {start}\n")
            start += count
        out.flush()
        seq += n


if __name__ == "__main__":
    main()
