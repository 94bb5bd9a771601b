"""A dispatch-file writer for crash tests: leases, drops and ends batches forever.

    python dispatch_file_writer.py PATH EPOCH FIRST_BATCH_ID SEED

It reloads the file, then records random work: a new batch (batch b is
segment b, slots 0..n-1, seq b * 1000 + slot), a drop of some slots of a
live batch, or the end of one; it compacts when the file is mostly garbage.
It prints each operation before it records it (`lease B N SESSION`,
`drop B SLOT...`, `end B`, `compact`), and `synced` after each `sync()`:
every operation printed before a `synced` line is durable; one printed
after the last `synced` may or may not be (`maybe_sync` runs in between).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu.dispatch.file import DispatchFile
from gpu.dispatch.file_format import LEASE_DTYPE, Lease


def batch_items(batch_id: int, n: int) -> np.ndarray:
    items = np.zeros(n, LEASE_DTYPE)
    items["segment"] = batch_id
    items["slot"] = np.arange(n)
    items["seq"] = batch_id * 1000 + items["slot"]
    return items


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    path, epoch, batch_id, seed = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    rng = np.random.default_rng(seed)
    file, leases = DispatchFile.open(path, epoch, sync_entries=8, sync_ms=5.0)
    live = {lease.batch_id: lease for lease in leases}
    while True:
        pick = rng.random()
        if pick < 0.35 or not live:
            n = int(rng.integers(1, 200))
            session = f"worker-{seed}-{batch_id % 3}"
            live[batch_id] = Lease(batch_id, session, batch_items(batch_id, n))
            say(f"lease {batch_id} {n} {session}")
            file.lease(batch_id, session, live[batch_id].items)
            batch_id += 1
        else:
            lease = live[list(live)[int(rng.integers(len(live)))]]
            if pick < 0.65:
                gone = rng.random(len(lease.items)) < 0.3
                slots = lease.items["slot"][gone]
                say(" ".join(map(str, ["drop", lease.batch_id, *slots.tolist()])))
                file.drop(lease.batch_id, slots)
                lease.items = lease.items[~gone]
            else:
                say(f"end {lease.batch_id}")
                file.drop(lease.batch_id)
                del live[lease.batch_id]
        file.maybe_sync(time.monotonic())
        if file.garbage_ratio > 0.5 and file.file_bytes > 1 << 14:
            say("compact")
            file.compact(list(live.values()))
        if rng.random() < 0.2:
            if not file.sync():
                sys.exit("sync failed")
            say("synced")


if __name__ == "__main__":
    main()
