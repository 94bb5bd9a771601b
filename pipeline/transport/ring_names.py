"""A ring's POSIX shared-memory name: one per (broker data dir, source stage, destination
stage, number), portable (macOS allows 30 characters after the NUL is counted), and checked
before any handle opens one (pipeline/transport/ring.py).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from pipeline.core.errors import RingError

NAME_MAX_CHARS = 30  # macOS PSHMNAMLEN is 31 with the NUL; Linux allows 255

_NAME_RE = re.compile(r"/[A-Za-z0-9._-]{1,29}\Z")
_STAGE_RE = re.compile(r"[a-z][a-z0-9_]*\Z")


def ring_name(data_dir: Path | str, src_stage: str, dst_stage: str, n: int) -> str:
    """The POSIX name of ring `n` from `src_stage` to `dst_stage` of the broker at `data_dir`.

    `/if<8 hex of the data dir>.<src>.<dst>.<n>`, or `/if<dir>.<8 hex of src/dst>.<n>`
    when that is longer than 30 characters. The data dir hash keeps two brokers on
    one host apart; `ls /dev/shm/if<dir>*` lists one broker's rings.
    """
    for what, stage in (("src_stage", src_stage), ("dst_stage", dst_stage)):
        if not isinstance(stage, str) or not _STAGE_RE.match(stage):
            raise RingError(f"{what} {stage!r} is not a stage name: use [a-z][a-z0-9_]*")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 10**6:
        raise RingError(f"ring number {n!r} must be an int in 0..999999")
    resolved = os.path.realpath(os.fspath(data_dir))
    prefix = "/if" + hashlib.blake2b(resolved.encode(), digest_size=4).hexdigest()
    name = f"{prefix}.{src_stage}.{dst_stage}.{n}"
    if len(name) <= NAME_MAX_CHARS:
        return name
    route = hashlib.blake2b(f"{src_stage}\0{dst_stage}".encode(), digest_size=4).hexdigest()
    return f"{prefix}.{route}.{n}"


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RingError(
            f"ring name {name!r} is not a portable POSIX shared-memory name: "
            f"'/' then 1-29 of [A-Za-z0-9._-]; build it with ring_name()"
        )
