"""Run recover() on one data dir in a fresh process and print its peak memory as JSON.

Used by bench/segment.py, so that the peak reflects recovery alone:
`python bench/recovery_probe.py DATA_DIR`. ru_maxrss is in KiB on Linux; for
RUSAGE_CHILDREN it is the peak of the largest scan worker.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.store.datadir import DataDir
from pipeline.store.recovery import recover


def _vm_hwm_kib() -> int:
    """Peak resident set of this process's own address space, from /proc (a cross-check)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def main(data_path: str) -> None:
    data_dir = DataDir(data_path)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data_dir.lock()
    try:
        report = recover(data_dir)
    finally:
        data_dir.unlock()
    result = {
        "before_kib": before_kib,
        "self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "vm_hwm_kib": _vm_hwm_kib(),
        "children_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        "live": report.live,
        "segments": len(report.segments),
        "elapsed_s": report.elapsed_s,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
