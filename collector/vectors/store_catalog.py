"""Named vector stores under `<data_dir>/vectors/`: what each holds, and opening them.

| path                                   | what                                                    |
|----------------------------------------|---------------------------------------------------------|
| `vectors/<store>/store.json`           | `name`, `model`, `dim`, `dtype`, `shard_rows`, `created_ns`; written once, atomically, before the first shard; `<store>` is the store's name made file-safe (pipeline/core/file_names.py: `intfloat/e5-mistral-7b-instruct` is `intfloat%2Fe5-mistral-7b-instruct`) |
| `vectors/<store>/<id>.payload/.ids/.journal` | the shards (collector/vectors/shard.py)           |
| `vectors/errors/<job>.jsonl`           | OpenAI Batch error lines of the job's results that are not stored vectors (failed items, wrong model or dim, NaN) |
| `vectors/delivered/<job>`              | empty: every result of the job was delivered (collector/vectors/sink.py) |

A store's name follows the rule of model names (pipeline/store/model_names.py),
since a store is named after its model unless the job names one
(`--deliver vectors:STORE`). A store is created by the vector sink when the first embedding for it
arrives: its dim is that embedding's, its dtype `vectors.dtype`, and a shard
holds `vectors.shard_bytes` of payload. The ids row of a vector is the
item's global id, its seq (pipeline/core/item_seq.py `seq_of`), which
leads back to its job and `custom_id`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from collector.vectors.vector_errors import VectorInputError, VectorShardError
from collector.vectors.vector_rows import DTYPES
from collector.vectors.vector_store import VectorStore
from pipeline.core.file_names import file_safe, from_file_safe
from pipeline.store.durable import write_whole
from pipeline.store.model_names import NAME_RULE, name_problem

META_FILE = "store.json"
SINK_DIRS = ("errors", "delivered")


@dataclass(frozen=True)
class StoreMeta:
    name: str
    model: str
    dim: int
    dtype: str
    shard_rows: int
    created_ns: int


def stores_root(data_path: Path) -> Path:
    return Path(data_path) / "vectors"


def store_names(root: Path) -> list[str]:
    """Stores under `root` (directories with a store.json), sorted."""
    if not root.is_dir():
        return []
    return sorted(store_name_of(p) for p in root.iterdir() if (p / META_FILE).exists())


def store_name_of(directory: Path) -> str:
    """The name of the store in `directory` (its file-safe form undone)."""
    try:
        return from_file_safe(directory.name)
    except UnicodeDecodeError:
        return directory.name  # not a name file_safe made: check_store_name refuses it


def store_dirs(root: Path) -> list[Path]:
    """Every directory under `root` that is not the sink's own (errors/, delivered/)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SINK_DIRS)


def check_store_name(name: str) -> str:
    problem = name_problem(name) or ("is the sink's own directory" if name in SINK_DIRS else None)
    if problem is not None:
        raise VectorInputError(
            f"store name {name!r} is not allowed: it {problem}; a store name is {NAME_RULE} "
            f"(not {' or '.join(SINK_DIRS)})"
        )
    return name


def store_dir(root: Path, name: str) -> Path:
    """The directory of store `name` under `root`."""
    return Path(root) / file_safe(check_store_name(name))


def read_meta(directory: Path) -> StoreMeta:
    """The store's store.json, or VectorShardError saying what is wrong with it."""
    path = directory / META_FILE
    try:
        data = orjson.loads(path.read_bytes())
        meta = StoreMeta(
            str(data["name"]),
            str(data["model"]),
            int(data["dim"]),
            str(data["dtype"]),
            int(data["shard_rows"]),
            int(data.get("created_ns", 0)),
        )
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise VectorShardError(f"{path}: unreadable store description ({exc})") from exc
    if meta.dtype not in DTYPES or meta.dim < 1 or meta.shard_rows < 1:
        raise VectorShardError(f"{path}: store description {asdict(meta)} is not valid")
    return meta


def create_store(
    root: Path, name: str, model: str, dim: int, dtype: str, shard_bytes: int
) -> tuple[StoreMeta, VectorStore]:
    """Create store `name` for `model`'s `dim`-wide vectors: store.json first, durably."""
    directory = store_dir(root, name)
    directory.mkdir(parents=True, exist_ok=True)
    row_bytes = dim * DTYPES[dtype].itemsize
    meta = StoreMeta(name, model, dim, dtype, max(1, shard_bytes // row_bytes), time.time_ns())
    write_whole(directory / META_FILE, orjson.dumps(asdict(meta)), also_sync=(root,))
    return meta, VectorStore(directory, dim, dtype, meta.shard_rows)


def open_store(root: Path, name: str, readonly: bool = False) -> tuple[StoreMeta, VectorStore]:
    """Open (and, unless `readonly`, recover) an existing store."""
    directory = store_dir(root, name)
    meta = read_meta(directory)
    return meta, VectorStore(directory, meta.dim, meta.dtype, meta.shard_rows, readonly=readonly)


class StoreSet:
    """Every store under one root, opened (and recovered) at once; one owner, the vector stage.

    A store that fails recovery is kept in `broken` with the reason: it is
    never served or appended to, and `python run.py check` reports it.
    """

    def __init__(self, root: Path, dtype: str, shard_bytes: int, readonly: bool = False) -> None:
        self.root, self.dtype, self.shard_bytes = Path(root), dtype, shard_bytes
        self.readonly = readonly
        self.open: dict[str, tuple[StoreMeta, VectorStore]] = {}
        self.broken: dict[str, str] = {}
        for name in store_names(self.root):
            try:
                self.open[name] = open_store(self.root, name, readonly)
            except (VectorShardError, VectorInputError, OSError) as exc:
                self.broken[name] = str(exc)

    def get(self, name: str) -> tuple[StoreMeta, VectorStore]:
        """An open store, or VectorInputError (unknown) / VectorShardError (failed recovery)."""
        if name in self.open:
            return self.open[name]
        if name in self.broken:
            raise VectorShardError(f"store {name!r} is not served: {self.broken[name]}")
        known = ", ".join(sorted(self.open)) or "none yet"
        raise VectorInputError(f"no vector store {name!r} (stores: {known})")

    def create(self, name: str, model: str, dim: int) -> tuple[StoreMeta, VectorStore]:
        self.open[name] = create_store(self.root, name, model, dim, self.dtype, self.shard_bytes)
        return self.open[name]

    def pending(self) -> bool:
        return any(store.pending_rows for _, store in self.open.values())

    def flush(self) -> int:
        """Flush every store with queued rows; returns the rows made durable (raises on failure)."""
        durable = 0
        for _, store in self.open.values():
            if store.pending_rows:
                durable += sum(count for _, _, count in store.flush())
        return durable

    def close(self) -> None:
        for _, store in self.open.values():
            store.close()
        self.open.clear()
