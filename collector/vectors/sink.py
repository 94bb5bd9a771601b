"""The vector sink: delivers `--deliver vectors[:STORE]` jobs from completion into stores, once.

With completion (collector/completion/delivery.py), one page per job in flight,
through the delivery client every results consumer shares
(collector/delivery_client.py):

1. FETCH `{job, ack, sink: "vectors", limit, req}` -> RESULT_PAGE, which echoes `req`
   (an answer to an older request is dropped).
2. The page's embeddings are appended to their store (queued, not yet durable).
   Its other results (failed items; a result that is not an embedding, of
   another dim or model than the store's, or not finite) become OpenAI Batch
   error lines in `vectors/errors/<job>.jsonl`, written and fsynced at once.
3. At the next scheduled flush (`vectors.flush_ms`) the stores are made
   durable; only then does the job's next FETCH carry `ack` = that page, and
   completion marks its results delivered (invariant 12). A failed flush
   (a full disk) acknowledges nothing; the rows stay queued for the next.
4. An empty page of a finished job with nothing undelivered ends it:
   `vectors/delivered/<job>` is written and the job is forgotten.

Exactly once. The store does not deduplicate; the sink does. A page can come
back (the sink or completion restarted between a flush and its ack), so the
sink keeps, per job being delivered, a bitmap of the items already stored.
It is rebuilt at start from the stores' ids files (an id is the item's global
id, its seq: pipeline/core/item_seq.py), and an item already there is skipped. Error lines
are deduplicated by their file (collector/delivery/result_file.py `ResultFile`).

Lines of several parts (an embeddings `input` list: docs/completion.md,
"Lines and parts") land as one vector per part. Completion's page then gives
`index` = the line's index, `part` and `item` = each row's own item index,
and a vector's id is its part's item seq: `job_no << 32 | item`, with item =
line - 1 for part 0 and the part-region index the job's chunk journal gives
part p >= 1 (pipeline/core/item_seq.py `PART_BASE`); `run.py vectors` shows each
hit's and row's custom_id and part. The bitmap is of items, so a page sent
again skips exactly the parts already stored. A failed part is one error
line for its line (keyed by custom_id, so at most one per line), its message
starting `part P: `; the line's other parts are stored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from collector.delivery.lines import error_line
from collector.delivery.result_file import ResultFile
from collector.delivery_client import Delivery
from collector.vectors.store_catalog import StoreSet
from pipeline.core.errors import FabricError, IngestError
from pipeline.core.index_bitmap import ItemIndexSet
from pipeline.core.item_seq import index_of, job_of, seq_of
from pipeline.core.ragged import Ragged
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.job_files import JobFiles
from pipeline.store.job_record import DELIVER_FILE, DELIVER_VECTORS

IDLE_POLL_S = 0.25  # a job with nothing new is asked again this often
BROKEN_RETRY_S = 30.0  # a job whose store is not served is asked again this often
REFUSED = "vector_refused"  # error code of a result the store cannot take


@dataclass
class SinkJob:
    """One job being delivered to stores."""

    job_id: str
    job_no: int
    deliver: str  # "vectors" or "vectors:STORE"
    delivery: Delivery  # FETCH, the req echo, ack once the stores are flushed
    have: ItemIndexSet = field(default_factory=ItemIndexSet)  # the item indexes stored
    stored: int = 0
    skipped: int = 0
    errors: int = 0
    error_file: ResultFile | None = None  # opened at the first error line, kept until the end


class VectorSink:
    """Decides what to fetch, turns pages into appends and error lines; the vector stage sends."""

    def __init__(
        self, stores: StoreSet, job_files: JobFiles, page_items: int, log: logging.Logger
    ) -> None:
        self.stores = stores
        self.job_files = job_files
        self.page_items = page_items
        self.log = log
        self.delivered_dir = stores.root / "delivered"
        self.errors_dir = stores.root / "errors"
        for directory in (self.delivered_dir, self.errors_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.jobs: dict[str, SinkJob] = {}
        self.rows_stored = 0  # appended by this life of the sink
        self.seen: set[str] = set()  # job ids looked at (delivered or not ours)
        self.delivered_jobs = len(os.listdir(self.delivered_dir))
        self.discover()
        self._rebuild_bitmaps()

    # ---- which jobs ------------------------------------------------------------------
    def discover(self) -> list[str]:
        """Start delivering jobs submitted with `--deliver vectors` since the last look."""
        found = []
        for job_id in self.job_files.names():
            if job_id in self.seen:
                continue
            if not self.job_files.has_record(job_id):
                continue  # being created: look again next time
            self.seen.add(job_id)
            try:
                meta = self.job_files.read_record(job_id)
            except (OSError, IngestError) as exc:
                self.log.error("job %s: unreadable job.json (%s); not delivered", job_id, exc)
                continue
            deliver = str(meta.get("deliver", DELIVER_FILE))
            if not deliver.startswith(DELIVER_VECTORS):
                continue
            if (self.delivered_dir / job_id).exists():
                continue
            fetch = {"sink": "vectors", "limit": self.page_items}
            self.jobs[job_id] = SinkJob(
                job_id, int(meta["job_no"]), deliver, Delivery(job_id, fetch)
            )
            found.append(job_id)
        return found

    def _rebuild_bitmaps(self) -> None:
        """Mark the items of jobs being delivered that a store already holds (one pass of ids)."""
        if not self.jobs:
            return
        by_no = {job.job_no: job for job in self.jobs.values()}
        numbers = np.array(sorted(by_no), np.int64)
        for _, store in self.stores.open.values():
            for ids in store.ids():
                job_nos = job_of(ids)
                mine = np.isin(job_nos, numbers)
                if not mine.any():
                    continue
                for job_no in np.unique(job_nos[mine]).tolist():
                    index = index_of(ids[job_nos == job_no])
                    by_no[job_no].have.add(index)
                    by_no[job_no].stored += len(index)

    # ---- fetching --------------------------------------------------------------------
    def due(self, now: float) -> list[dict]:
        """FETCH metas to send now (each job at most one in flight)."""
        return [meta for job in self.jobs.values() if (meta := job.delivery.ask(now))]

    def on_page(self, meta: dict, arrays: dict, now: float) -> None:
        job = self.jobs.get(str(meta.get("job")))
        if job is None or not job.delivery.counts(meta):
            return  # an answer to an older request, or a job already finished
        index = np.asarray(arrays["index"]).astype(np.int64)  # the line's (line - 1)
        if not len(index):
            if job.delivery.done(meta, 0):
                self._finish(job)
            else:
                job.delivery.idle(now, IDLE_POLL_S)
            return
        try:
            item = np.asarray(arrays.get("item", index)).astype(np.int64)  # the row's own
            appended = self._deliver(job, meta, arrays, index, item)
        except (FabricError, OSError) as exc:  # a store not served, a full disk, ...
            self.log.error("job %s: page not delivered, asked again later: %s", job.job_id, exc)
            job.delivery.idle(now, BROKEN_RETRY_S)
            return
        job.delivery.written(meta)
        if not appended:  # nothing waits for a flush: acknowledge at once
            job.delivery.durable(now)

    def flushed(self, now: float) -> None:
        """Every store is durable up to now: pages appended before may be acknowledged."""
        for job in self.jobs.values():
            job.delivery.durable(now)

    def _finish(self, job: SinkJob) -> None:
        marker = self.delivered_dir / job.job_id
        marker.write_bytes(b"")
        self.log.info(
            "job %s delivered to vectors: %d stored, %d error line(s), %d sent again and skipped",
            job.job_id,
            job.stored,
            job.errors,
            job.skipped,
        )
        if job.error_file is not None:
            job.error_file.close()
        del self.jobs[job.job_id]
        self.delivered_jobs += 1

    def close(self) -> None:
        for job in self.jobs.values():
            if job.error_file is not None:
                job.error_file.close()

    # ---- one page --------------------------------------------------------------------
    def _deliver(
        self, job: SinkJob, meta: dict, a: dict, index: np.ndarray, item: np.ndarray
    ) -> int:
        """Append the page's vectors (row i is item `item[i]` of line `index[i]`) and write its
        error lines; returns rows appended."""
        custom_ids = meta["custom_ids"]
        models = {int(k): v for k, v in meta["models"].items()}
        status, kind = np.asarray(a["status"]), np.asarray(a["kind"])
        offsets = np.asarray(a["offsets"]).astype(np.int64)
        payload = np.asarray(a["payload"], np.uint8)
        sizes = np.diff(offsets)
        refused: dict[int, str] = {}  # page row -> why the store cannot take it
        appended = 0
        result = status == ResultStatus.RESULT
        ok = result & (kind == ResultKind.VECTOR)
        for i in np.flatnonzero(result & ~ok).tolist():
            refused[i] = "the result is not an embedding; a vectors job takes /v1/embeddings"
        model_ids = np.asarray(a["model"])
        for model_id in np.unique(model_ids[ok]).tolist():
            rows = np.flatnonzero(ok & (model_ids == model_id))
            model = models.get(model_id, "")
            name = job.deliver.partition(":")[2] or model
            if name not in self.stores.open and name not in self.stores.broken:
                if sizes[rows[0]] % 4 or not sizes[rows[0]]:
                    for i in rows.tolist():
                        refused[i] = f"the embedding has {int(sizes[i])} bytes, not float32s"
                    continue
                self.stores.create(name, model, int(sizes[rows[0]]) // 4)
                self.log.info("vector store %s created for %s", name, model)
            store_meta, store = self.stores.get(name)
            if store_meta.model != model:
                for i in rows.tolist():
                    refused[i] = f"store {name} holds {store_meta.model} vectors, not {model}"
                continue
            fits = sizes[rows] == store_meta.dim * 4
            for i in rows[~fits].tolist():
                refused[i] = (
                    f"the embedding has {int(sizes[i]) / 4:g} values; store {name} holds "
                    f"dim {store_meta.dim}"
                )
            rows = rows[fits]
            already = job.have.has(item[rows])
            job.skipped += int(already.sum())
            rows = rows[~already]
            if not len(rows):
                continue
            data = Ragged(payload, offsets).take(rows).values
            vectors = data.view("<f4").reshape(len(rows), store_meta.dim)
            finite = np.isfinite(vectors).all(axis=1)
            for i in rows[~finite].tolist():
                refused[i] = "the embedding has NaN or infinite values"
            if not finite.all():
                rows, vectors = rows[finite], vectors[finite]
            ids = seq_of(job.job_no, item[rows])
            try:
                store.append(ids, vectors, copy=False)  # `vectors`: this page's gathered copy
            except FabricError as exc:  # a failed rotation: the rows queued before it stay
                queued = getattr(exc, "rows_queued", 0)
                job.have.add(item[rows[:queued]])
                job.stored += queued
                self.rows_stored += queued
                raise
            job.have.add(item[rows])
            job.stored += len(rows)
            self.rows_stored += len(rows)
            appended += len(rows)
        part = a.get("part")
        self._write_errors(job, index, part, custom_ids, status, offsets, payload, refused)
        return appended

    def _write_errors(self, job, index, part, custom_ids, status, offsets, payload, refused):
        def named(i: int, text: bytes) -> bytes:  # "part P: " before a part's message
            return text if part is None else b"part %d: " % int(part[i]) + text

        lines, keys = [], []
        for i in np.flatnonzero(status != ResultStatus.RESULT).tolist():
            code, sep, message = payload[offsets[i] : offsets[i + 1]].tobytes().partition(b": ")
            stored = code + sep + named(i, message) if sep else named(i, code)
            line, key = error_line(job.job_id, int(index[i]), custom_ids[i], stored)
            lines.append(line)
            keys.append(key)
        for i, why in sorted(refused.items()):
            line, key = error_line(
                job.job_id, int(index[i]), custom_ids[i], named(i, why.encode()), REFUSED
            )
            lines.append(line)
            keys.append(key)
        if not lines:
            return
        if job.error_file is None:  # opening reads the file's keys: once per job, not per page
            job.error_file = ResultFile.open(self.errors_dir / f"{job.job_id}.jsonl")
        try:
            job.errors += job.error_file.write(lines, keys)
            job.error_file.sync()
        except (FabricError, OSError):
            job.error_file.close()  # a failed write leaves it unusable: opened again next time
            job.error_file = None
            raise
