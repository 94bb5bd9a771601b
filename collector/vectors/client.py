"""Users' side of the vector store: stats, search (by text or vector) and export.

`python run.py vectors stats|search|export` (cli/vectors.py) calls these. A text
query is embedded here, with the store's model's own tokenizer and engine
(the same code the workers run), then searched by the vector stage
(collector/vectors/vector_stage.py), which answers with the hits' custom_ids.
Export pages through the store with VECTORS_READ and writes `.npy` (rows;
ids, custom_ids and parts beside it in `<out>.ids.jsonl`) or `.parquet` (one
row per vector: job, custom_id, part, id, shard, row, embedding; needs
pyarrow). `part` is the vector's place in its line's `input` list (0 for a
line of one input; collector/vectors/sink.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from collector.vectors.vector_errors import VectorInputError
from pipeline.core.ragged import pad
from pipeline.transport import wire
from pipeline.transport.broker_client import BrokerClient

MT = wire.MessageType
READ_ROWS = 65536


class VectorsClient(BrokerClient):
    """Talks to the vector stage (`vectors.bind`)."""

    def stats(self) -> dict[str, Any]:
        return self.request(MT.VECTORS_STATS, {}, MT.VECTORS_INFO).meta

    def job_delivered(self, job_id: str) -> bool:
        """Whether every result of `job_id` has been delivered to the stores."""
        return bool(
            self.request(MT.VECTORS_STATS, {"job": job_id}, MT.VECTORS_INFO).meta["job_delivered"]
        )

    def store(self, name: str) -> dict[str, Any]:
        for store in self.stats()["stores"]:
            if store["name"] == name:
                if not store.get("served", True):
                    raise VectorInputError(f"store {name!r} is not served: {store['reason']}")
                return store
        raise VectorInputError(f"no vector store {name!r} on this broker")

    def search(self, store: str, query: np.ndarray, k: int, metric: str) -> wire.Message:
        query = np.ascontiguousarray(np.atleast_2d(query), np.float32)
        return self.request(
            MT.VECTORS_SEARCH,
            {"store": store, "k": k, "metric": metric},
            MT.VECTORS_HITS,
            arrays={"query": query},
        )

    def read(self, store: str, shard: int, first: int, count: int, names: bool) -> wire.Message:
        meta = {"store": store, "shard": shard, "first": first, "count": count, "names": names}
        return self.request(MT.VECTORS_READ, meta, MT.VECTORS_ROWS)

    def export(
        self, store: str, out: Path, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Write every durable row of `store` to `out` (.npy or .parquet); returns rows written."""
        info = self.store(store)
        total, dim = int(info["rows"]), int(info["dim"])
        suffix = out.suffix.lower()
        if suffix not in (".npy", ".parquet"):
            raise VectorInputError(
                f"{out}: export writes .npy or .parquet, not {suffix or '(none)'}"
            )
        pages = self._pages(store, int(info["shards"]))
        if suffix == ".npy":
            return _write_npy(out, pages, total, dim, info["dtype"], progress)
        return _write_parquet(out, pages, total, progress)

    def _pages(self, store: str, shards: int):
        for shard in range(shards):
            first = 0
            while True:
                page = self.read(store, shard, first, READ_ROWS, names=True)
                n = len(page.arrays["ids"])
                if n:
                    yield shard, first, page
                first += n
                if not n or first >= int(page.meta["shard_rows"]):
                    break


def _write_npy(out: Path, pages, total: int, dim: int, dtype: str, progress) -> int:
    tmp = out.with_name(out.name + ".tmp")
    ids_tmp = out.with_name(out.name + ".ids.jsonl.tmp")
    matrix = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.dtype(dtype), shape=(total, dim))
    done = 0
    with open(ids_tmp, "wb") as ids_out:
        for shard, first, page in pages:
            rows = page.arrays["rows"]
            n = min(len(rows), total - done)  # rows flushed after the count was taken wait
            matrix[done : done + n] = rows[:n]
            for i in range(n):
                ids_out.write(
                    orjson.dumps(
                        {
                            "row": done + i,
                            "job": page.meta["jobs"][i],
                            "custom_id": page.meta["custom_ids"][i],
                            "part": page.meta.get("parts", [0] * n)[i],
                            "id": int(page.arrays["ids"][i]),
                            "shard": shard,
                            "shard_row": first + i,
                        },
                        option=orjson.OPT_APPEND_NEWLINE,
                    )
                )
            done += n
            if progress is not None:
                progress(done, total)
            if done >= total:
                break
        ids_out.flush()
        os.fsync(ids_out.fileno())
    matrix.flush()
    del matrix
    os.replace(tmp, out)
    os.replace(ids_tmp, out.with_name(out.name + ".ids.jsonl"))
    return done


def _write_parquet(out: Path, pages, total: int, progress) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise VectorInputError(
            "parquet export needs pyarrow: pip install pyarrow (or export to .npy)"
        ) from exc
    tmp = out.with_name(out.name + ".tmp")
    writer = None
    done = 0
    try:
        for shard, first, page in pages:
            rows = page.arrays["rows"]
            n = min(len(rows), total - done)
            flat = pa.array(np.ascontiguousarray(rows[:n]).reshape(-1))
            table = pa.table(
                {
                    "job": pa.array(page.meta["jobs"][:n], pa.string()),
                    "custom_id": pa.array(page.meta["custom_ids"][:n], pa.string()),
                    "part": pa.array(page.meta.get("parts", [0] * n)[:n], pa.uint32()),
                    "id": pa.array(page.arrays["ids"][:n]),
                    "shard": pa.array(np.full(n, shard, np.uint32)),
                    "row": pa.array(np.arange(first, first + n, dtype=np.uint64)),
                    "embedding": pa.FixedSizeListArray.from_arrays(flat, rows.shape[1]),
                }
            )
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
            done += n
            if progress is not None:
                progress(done, total)
            if done >= total:
                break
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise VectorInputError("the store holds no durable rows yet; nothing exported")
    os.replace(tmp, out)
    return done


def embed_texts(settings, model_name: str, texts: list[str]) -> np.ndarray:
    """Embed `texts` with `model_name`'s tokenizer and engine, as a worker would: float32 [n, dim]."""
    from gpu.engines.base import EMBED, EngineBatch
    from gpu.engines.registry import make_engine
    from ingest.tokenize import ModelTokenizer

    model = settings.model(model_name)
    tokenizer = ModelTokenizer.load(model)
    tokens, offsets = tokenizer.encode(texts)
    lengths = np.diff(offsets).astype(np.uint32)
    if int(lengths.max()) > model.max_tokens:
        raise VectorInputError(
            f"the query has {int(lengths.max())} tokens; model {model_name} takes {model.max_tokens}"
        )
    padded = pad(tokens, offsets[:-1], lengths)
    options = {"tokens_per_s": 1e9} if model.engine == "simulated" else {}
    engine = make_engine(model.engine, **options)
    engine.load()
    result = engine.run(EngineBatch(EMBED, padded, lengths))
    if result.embeddings is None or any(e is not None for e in result.errors):
        raise VectorInputError(f"model {model_name} could not embed the query: {result.errors}")
    return np.asarray(result.embeddings, np.float32)
