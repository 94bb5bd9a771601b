"""An intern table: each distinct value (a JSON dict) stored once, durably, under a small id.

Items carry only the id. Two tables use it: the shape table (this module's
default file) and completion's models table (`models.log`, collector/completion/results_log.py).

A shape is everything besides the tokens that must be equal inside one GPU
batch (task, sampling parameters, output budget, priority), as a canonical
dict (`ingest.request_shape.Shape.as_dict()`). The table is a file such as
`<data_dir>/shapes.log`, a RecordLog of `{"id": n, "shape": {...}}` (the
field is named "shape" in every table, models.log too), shared by every stage. Ids start at 1, increase, and are never reused. A process
adds a shape under an exclusive flock on the file, after re-reading what
others added, and syncs it before using the id, so an id in a durable item
always has a durable shape.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import orjson

from pipeline.core.errors import FabricError
from pipeline.store.records import RecordLog, read_records

FILE = "shapes.log"


def _canonical(shape: dict[str, Any]) -> bytes:
    return orjson.dumps(shape, option=orjson.OPT_SORT_KEYS)


class InternTable:
    """Value dict <-> id, backed by `<data_dir>/<file>` (default shapes.log)."""

    def __init__(self, data_root: Path, file: str = FILE) -> None:
        self.path = Path(data_root) / file
        self._by_key: dict[bytes, int] = {}
        self._by_id: dict[int, dict[str, Any]] = {}
        self.reload()

    def reload(self) -> None:
        records, _ = read_records(self.path)
        for record in records:
            self._remember(record["id"], record["shape"])

    def _remember(self, value_id: int, value: dict[str, Any]) -> None:
        self._by_key.setdefault(_canonical(value), value_id)
        self._by_id[value_id] = value

    def id_for(self, value: dict[str, Any]) -> int:
        """The id of `value`, adding it durably if it is new."""
        key = _canonical(value)
        found = self._by_key.get(key)
        if found is not None:
            return found
        lock_fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            log = RecordLog(self.path)
            try:
                for record in log.records:
                    self._remember(record["id"], record["shape"])
                found = self._by_key.get(key)
                if found is None:
                    found = max(self._by_id, default=0) + 1
                    log.append({"id": found, "shape": orjson.loads(key)})
                    log.sync()
                    self._remember(found, orjson.loads(key))
            finally:
                log.close()
        finally:
            os.close(lock_fd)
        return found

    def value(self, value_id: int) -> dict[str, Any]:
        """The value of `value_id`; re-reads the table once if it is not known yet."""
        if value_id not in self._by_id:
            self.reload()
        try:
            return self._by_id[value_id]
        except KeyError:
            raise FabricError(f"id {value_id} is not in {self.path}") from None

    def get(self, value_id: int) -> dict[str, Any] | None:
        """The value of `value_id`, or None if the table does not have it (after one re-read)."""
        try:
            return self.value(value_id)
        except FabricError:
            return None
