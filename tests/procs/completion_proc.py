"""A completion process for crash tests: records results for the LIVE input slots, printing
`acked SEGMENT SLOT...` once their tombstones are durable.

    python completion_proc.py DATA_DIR SEED
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from collector.completion.results_log import CompletionLog, Results
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.store.segment_format import LIVE, STATE_MASK


def main() -> None:
    data_dir = DataDir(sys.argv[1])
    rng = np.random.default_rng(int(sys.argv[2]))
    inputs = {}
    for path in data_dir.segments.glob("in-*.seg"):
        seg = Segment.open(path, writable=True)
        inputs[seg.segment_id] = seg
    log = CompletionLog(data_dir, inputs.__getitem__, segment_bytes=1 << 16)
    while True:
        segment_id = int(rng.choice(sorted(inputs)))
        seg = inputs[segment_id]
        live = np.flatnonzero((seg.markers[: seg.entries] & STATE_MASK) == LIVE)
        if len(live) == 0:
            if all(((s.markers[: s.entries] & STATE_MASK) != LIVE).all() for s in inputs.values()):
                print("done", flush=True)
                return
            continue
        slots = rng.choice(live, min(len(live), int(rng.integers(1, 8))), replace=False)
        seqs = seg.slots["seq"][slots]
        sizes = rng.integers(1, 60, len(slots))
        payload = np.concatenate([np.full(s, i % 251, np.uint8) for i, s in enumerate(sizes)])
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        status = (seqs % 7 == 0).astype(np.uint32)
        log.record(
            Results(
                "job-c",
                7,
                np.full(len(slots), segment_id, np.uint64),
                slots,
                seqs,
                status,
                payload,
                offsets,
            )
        )
        done = log.flush_tombstones()
        for sid, retired in done.items():
            print("acked", sid, *retired.tolist(), flush=True)


if __name__ == "__main__":
    main()
