"""What dispatch and workers exchange, and what a worker may rely on (docs/wire.md).

The worker SDK runs on remote GPU hosts: it depends on this module, the wire
framing (`pipeline/transport/wire.py`), the result kinds (`pipeline/core/result_kinds.py`)
and the slot layout WORK ships (`pipeline/store/segment_format.py`), never on
dispatch's internal state.

`ITEM_DTYPE` is one item's descriptor in WORK, RESULTS, HELLO and RECLAIM
messages: where its slot lies and its seq (`pipeline/core/item_seq.py`).

| field     | type | meaning                                  |
|-----------|------|------------------------------------------|
| `segment` | u8   | the input segment's id                   |
| `slot`    | u4   | the slot's number in that segment        |
| `seq`     | u8   | the item's seq, `job_no << 32 \\| index`  |

`slot_key` names an item's slot by one u64, `segment << 32 | slot`: how a worker
matches the held items a WELCOME says are gone, and dispatch a RETIRED item (seqs are
not compared: the broker checked them when it handed the work out).
"""

from __future__ import annotations

import numpy as np

ITEM_DTYPE = np.dtype([("segment", "<u8"), ("slot", "<u4"), ("seq", "<u8")])


def slot_key(items: np.ndarray) -> np.ndarray:
    """One u64 per item of `items` (ITEM_DTYPE): its slot, `segment << 32 | slot`."""
    return (items["segment"].astype(np.uint64) << np.uint64(32)) | items["slot"].astype(np.uint64)
