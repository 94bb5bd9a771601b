"""A worker that writes down each batch its engine runs: `python bench/batch_log_worker.py CONFIG LOG`.

It is local worker 0 of the broker config CONFIG, with the options, engine
and threads the supervisor would give it (`WorkerOptions.from_settings`),
started by a benchmark instead of by the supervisor (the broker then runs
with `local = 0`), so that the benchmark can see what the engine was handed.
It appends one line to LOG per batch, when the engine is done with it:

| field   | meaning                                              |
|---------|------------------------------------------------------|
| began   | wall clock (`time.time()`) when the engine started it |
| seconds | wall seconds in the engine                           |
| lane    | the batch's width in tokens (its lane)               |
| items   | its rows                                             |
| tokens  | its real tokens (the sum of its rows' lengths)       |

`read_batches(LOG)` gives them back as a numpy record array.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH_DTYPE = np.dtype(
    [("began", "f8"), ("seconds", "f8"), ("lane", "i8"), ("items", "i8"), ("tokens", "i8")]
)


def logged(engine, log_path: Path):
    """`engine` with its `infer` wrapped to append one LOG line per batch."""
    infer = engine.infer
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 (open for the worker's life)

    def infer_logged(batch):
        began = time.time()
        result = infer(batch)
        seconds = time.time() - began
        lane, items = batch.tokens.shape[1], len(batch.lengths)
        log.write(f"{began:.6f} {seconds:.6f} {lane} {items} {int(batch.lengths.sum())}\n")
        return result

    engine.infer = infer_logged
    return engine


def read_batches(log_path: Path) -> np.ndarray:
    """The batches LOG holds, in the order they finished."""
    rows = [tuple(line.split()) for line in Path(log_path).read_text().splitlines() if line]
    return np.array(rows, np.dtype([(n, "U32") for n in BATCH_DTYPE.names])).astype(BATCH_DTYPE)


def main() -> int:
    from config import load_settings
    from config.stage_settings import worker_settings
    from gpu.engines.registry import make_engine
    from gpu.worker.options import WorkerOptions
    from gpu.worker.session import run_worker

    config, log_path = sys.argv[1], Path(sys.argv[2])
    options = WorkerOptions.from_settings(worker_settings(load_settings(config), 0))
    engine = make_engine(options.engine, **options.engine_options)
    return run_worker(options, logged(engine, log_path))


if __name__ == "__main__":
    sys.exit(main())
