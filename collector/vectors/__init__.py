"""Vector shards: a journalled, append-only home for embeddings (docs/vectors.md)."""

from collector.vectors.shard import Shard
from collector.vectors.vector_errors import (
    VectorError,
    VectorInputError,
    VectorSealedError,
    VectorShardError,
)
from collector.vectors.vector_store import VectorStore

__all__ = [
    "Shard",
    "VectorError",
    "VectorInputError",
    "VectorSealedError",
    "VectorShardError",
    "VectorStore",
]
