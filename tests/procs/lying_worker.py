"""A worker that lies (issue 14, point 2): `run.py worker`, whose RESULTS are damaged per item.

By the item's index in its job (its seq's low 32 bits) modulo 6:

| i % 6 | what the worker sends for an embedding item                     | completion's cause |
|-------|-----------------------------------------------------------------|--------------------|
| 0     | the honest result                                               | -                  |
| 1     | the payload two bytes short                                     | `wrong_size`       |
| 2     | kind 0 (token ids) for an embedding                             | `wrong_kind`       |
| 3     | status 5                                                        | `bad_status`       |
| 4     | its first value NaN                                             | `not_finite`       |
| 5     | one value more than the others                                 | `wrong_dimension`  |

    python tests/procs/lying_worker.py worker --broker ADDR --model M --engine echo ...

With FABRIC_LIES=N in its environment it lies in its first N RESULTS messages only, then
turns honest (so what it handed back can be computed again and stored).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu.worker import session

LIES = 6
honest_results = session.results_message


lies_left = int(os.environ.get("FABRIC_LIES", "-1"))  # < 0: for ever


def lying_results(items, lengths, result) -> dict:
    global lies_left
    arrays = honest_results(items, lengths, result)
    if lies_left == 0:
        return arrays
    lies_left -= 1
    payload, offsets = arrays["payload"], arrays["offsets"]
    lie = (items["seq"] & np.uint64(0xFFFFFFFF)).astype(np.int64) % LIES
    parts = []
    for i, part in enumerate(payload[offsets[i] : offsets[i + 1]] for i in range(len(items))):
        part = part.tobytes()
        if lie[i] == 1:
            part = part[:-2]
        elif lie[i] == 4:
            part = np.float32("nan").tobytes() + part[4:]
        elif lie[i] == 5:
            part += np.float32(1.0).tobytes()
        parts.append(part)
    arrays["payload"] = np.frombuffer(b"".join(parts), np.uint8)
    arrays["offsets"] = np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64)
    arrays["kind"] = np.where(lie == 2, 0, arrays["kind"]).astype(np.uint8)
    arrays["status"] = np.where(lie == 3, 5, arrays["status"]).astype(np.uint8)
    return arrays


if __name__ == "__main__":
    session.results_message = lying_results  # what the worker loop calls for every batch
    import run

    sys.exit(run.main(sys.argv[1:]))
