"""The `id` and `request_id` of an output line: 32 hex digits each, fixed by (job id, index).

A re-fetch of a line writes identical bytes, so neither may depend on when or
by whom the line is rendered: four splitmix64 finalisers of the item's index,
keyed by a blake2b digest of the job id. Each is a bijection of the index, so
ids never repeat inside a job. `id` is `batch_req_<first 32 digits>`;
`request_id` the next 32 (collector/delivery/lines.py gives the line forms).
"""

from __future__ import annotations

import hashlib

import numpy as np

_HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), dtype="<u2")  # byte -> hex
_U64 = np.uint64


def request_ids(job_id: str, index: np.ndarray) -> tuple[list[str], list[str]]:
    """(id hex, request_id hex) per item: 32 hex digits each, fixed by (job_id, index)."""
    text = request_id_hex(job_id, index).view("S32").astype("U32")
    return text[:, 0].tolist(), text[:, 1].tolist()


def request_id_hex(job_id: str, index: np.ndarray) -> np.ndarray:
    """[n, 64] u1: the id's 32 hex digits, then the request_id's, fixed by (job_id, index)."""
    keys = np.frombuffer(hashlib.blake2b(job_id.encode(), digest_size=32).digest(), dtype="<u8")
    x = np.asarray(index, dtype=_U64)[:, None] + keys.astype(_U64)[None, :]
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    x = x ^ (x >> _U64(31))
    raw = x.astype(">u8").view(np.uint8).reshape(len(x), 32)
    return np.take(_HEX_PAIRS, raw).view(np.uint8).reshape(len(x), 64)  # two digits a byte
