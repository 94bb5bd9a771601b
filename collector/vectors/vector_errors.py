"""The vector store's errors: one root (`VectorError`) and what each kind of failure means.

A `VectorShardError` (and `VectorShardBusy`) says a shard must not be served;
`VectorSealedError` and `VectorInputError` refuse one request and change nothing.
"""

from __future__ import annotations

from pipeline.core.errors import FabricError


class VectorError(FabricError):
    """Root of the vector store's errors."""


class VectorShardError(VectorError):
    """A shard's files fail recovery or a check; the shard must not be served."""


class VectorShardBusy(VectorShardError):
    """Another process has the shard open for appending (the broker's vector stage)."""


class VectorSealedError(VectorError):
    """An append was attempted on a sealed (immutable) shard."""


class VectorInputError(VectorError):
    """An append or read asked for something the shard cannot take (shape, dtype, NaN, range)."""
