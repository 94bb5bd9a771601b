"""What dispatch and workers exchange, and what a worker may rely on (docs/wire.md).

The worker SDK runs on remote GPU hosts: it depends on this module, the wire
framing (`pipeline/wire.py`), the result kinds (`pipeline/result_kinds.py`)
and the slot layout WORK ships (`pipeline/segment_format.py`), never on
dispatch's internal state.

`ITEM_DTYPE` is one item's descriptor in WORK, RESULTS, HELLO and RECLAIM
messages: where its slot lies and its seq (`pipeline/item_seq.py`).

| field     | type | meaning                                  |
|-----------|------|------------------------------------------|
| `segment` | u8   | the input segment's id                   |
| `slot`    | u4   | the slot's number in that segment        |
| `seq`     | u8   | the item's seq, `job_no << 32 \\| index`  |
"""

from __future__ import annotations

import numpy as np

ITEM_DTYPE = np.dtype([("segment", "<u8"), ("slot", "<u4"), ("seq", "<u8")])
