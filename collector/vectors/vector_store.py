"""A vector store: a directory of shards, rotating to a new shard at `shard_rows`.

Shards are numbered from 0; every shard but the newest is sealed. Rotation
seals the full shard (which flushes it) before creating the next, so a crash
between the two leaves a sealed newest shard and the next append creates
its successor. Opening the store opens every shard, recovering the newest
(see `collector.vectors.shard`), and refuses shards of another dim or dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from collector.vectors.shard import Shard
from collector.vectors.vector_errors import VectorInputError, VectorShardError
from collector.vectors.vector_rows import DTYPES
from pipeline.core.errors import FabricError


class VectorStore:
    """Appends go to the newest shard; `flush()` makes them durable and says which.

    `append` returns placements: an `(m, 3)` u64 array of `(shard, first_row,
    count)`, one row per shard the batch landed in, stable forever.
    """

    def __init__(
        self, directory: Path, dim: int, dtype: str, shard_rows: int, readonly: bool = False
    ) -> None:
        if dtype not in DTYPES:
            raise VectorInputError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if shard_rows < 1:
            raise VectorInputError(f"shard_rows {shard_rows!r} must be at least 1")
        self.directory = Path(directory)
        self.readonly = readonly
        if not readonly:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.dim, self.dtype, self.shard_rows = dim, DTYPES[dtype], shard_rows
        self._dtype_name = dtype
        self.shards: list[Shard] = []
        self._durable: list[tuple[int, int, int]] = []
        try:
            for shard_id in self._shard_ids():
                self._open_shard(shard_id)
        except BaseException:
            self.close()
            raise

    def _shard_ids(self) -> list[int]:
        ids = sorted(int(p.stem) for p in self.directory.glob("*.journal") if p.stem.isdigit())
        if ids != list(range(len(ids))):
            raise VectorShardError(
                f"{self.directory}: shard ids {ids} are not 0..{len(ids) - 1}; a shard is missing"
            )
        return ids

    def _open_shard(self, shard_id: int) -> None:
        shard = Shard.open(self.directory, shard_id, readonly=self.readonly)
        self.shards.append(shard)
        if (shard.dim, shard.dtype) != (self.dim, self.dtype):
            raise VectorShardError(
                f"{shard.journal_path}: shard holds dim {shard.dim} {shard.dtype}, the store "
                f"was opened for dim {self.dim} {self.dtype}"
            )
        if shard.rows > self.shard_rows:
            raise VectorShardError(
                f"{shard.journal_path}: {shard.rows} rows, above shard_rows {self.shard_rows}"
            )
        if len(self.shards) > 1 and not self.shards[-2].sealed:
            raise VectorShardError(
                f"{self.shards[-2].journal_path}: not sealed but shard {shard_id} follows it"
            )

    @property
    def rows(self) -> int:
        """Durable rows over all shards."""
        return sum(s.rows for s in self.shards)

    @property
    def pending_rows(self) -> int:
        """Rows appended, not yet durable."""
        return sum(s.pending_rows for s in self.shards)

    def ids(self):
        """Every shard's durable ids, one read-only memmap each."""
        return [s.read(0, s.rows)[0] for s in self.shards]

    def append(self, ids: np.ndarray, rows: np.ndarray, copy: bool = True) -> np.ndarray:
        """Queue a batch (validated whole first); returns its placements.

        A batch that crosses a rotation is queued shard by shard: if the
        rotation fails (a full disk), the error's `rows_queued` says how many
        leading rows were queued (or made durable by the seal) before it.
        `copy=False`: see `Shard.append` (the rows must not change until the flush).
        """
        if self.readonly:
            raise VectorInputError(f"{self.directory}: opened read-only")
        shard = self.shards[-1] if self.shards else self._writable()
        ids, rows = shard.validate(ids, rows, copy)
        placements = []
        start = 0
        while start < len(rows):
            try:
                shard = self._writable()
            except FabricError as exc:
                exc.rows_queued = start
                raise
            room = self.shard_rows - shard.rows - shard.pending_rows
            end = min(len(rows), start + room)
            _, first = shard.append(ids[start:end], rows[start:end], checked=True)
            placements.append((shard.shard_id, first, end - start))
            start = end
        return np.array(placements, dtype=np.uint64).reshape(-1, 3)

    def _writable(self) -> Shard:
        """The newest shard with room, sealing a full one and creating its successor."""
        if self.shards:
            shard = self.shards[-1]
            if shard.rows + shard.pending_rows < self.shard_rows and not shard.sealed:
                return shard
            if not shard.sealed:
                self._note(shard.shard_id, shard.flush())
                shard.seal()
        shard = Shard.create(self.directory, len(self.shards), self.dim, self._dtype_name)
        self.shards.append(shard)
        return shard

    def _note(self, shard_id: int, span: tuple[int, int]) -> None:
        if span[1]:
            self._durable.append((shard_id, *span))

    def flush(self) -> list[tuple[int, int, int]]:
        """Make queued rows durable; returns `(shard, first_row, count)` acknowledged since last time."""
        if self.shards and not self.shards[-1].sealed:
            self._note(self.shards[-1].shard_id, self.shards[-1].flush())
        durable, self._durable = self._durable, []
        return durable

    def read(self, shard_id: int, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """`(ids, rows)` of durable rows of one shard, memory-mapped read-only."""
        if not 0 <= shard_id < len(self.shards):
            raise VectorInputError(f"shard {shard_id} is not in {self.directory}")
        return self.shards[shard_id].read(first, count)

    def close(self) -> None:
        """Close every shard; rows not yet flushed are dropped, as after a crash."""
        for shard in self.shards:
            shard.close()
        self.shards.clear()

    def __enter__(self) -> VectorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
