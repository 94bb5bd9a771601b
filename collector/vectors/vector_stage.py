"""The vector stage: stores recovered, the sink fed, searches and reads answered.

Sockets (bound only once every store has been recovered; docs/vectors.md):

| socket          | kind   | peer                                                                 |
|-----------------|--------|----------------------------------------------------------------------|
| `vectors.bind`  | ROUTER | users: VECTORS_STATS / VECTORS_INFO, VECTORS_SEARCH / VECTORS_HITS, VECTORS_READ / VECTORS_ROWS, PING / PONG |
| `completion.bind` | DEALER | completion, as a results client: FETCH (`sink: "vectors"`) / RESULT_PAGE |

Every `vectors.flush_ms` the stores with queued rows are flushed (payload,
ids, then journal, each fdatasynced) and only then may the sink acknowledge
the pages those rows came from (collector/vectors/sink.py). A search runs in
this process over the durable rows, a block at a time
(collector/vectors/search.py); a read returns at most MAX_READ_ROWS rows.
"""

from __future__ import annotations

import time

import numpy as np
import zmq

from collector.job_view import JobIndex
from collector.vectors.search import search
from collector.vectors.sink import VectorSink
from collector.vectors.store_catalog import StoreSet, stores_root
from collector.vectors.vector_errors import VectorError, VectorInputError
from config.stage_settings import VectorStageSettings
from pipeline.core.errors import FabricError
from pipeline.core.item_seq import index_of, job_of
from pipeline.process.stage import Stage
from pipeline.store.job_files import JOB_ID
from pipeline.transport import wire
from pipeline.transport.security import ServerGate, internal_curve, secure_client
from pipeline.transport.topology import client_address

MT = wire.MessageType
MAX_READ_ROWS = 65536
MAX_K = 10_000
MAX_QUERIES = 1024
MAX_REQUEST_BYTES = 16 << 20  # a search of 1024 queries of 4096 float32 values
DISCOVER_S = 1.0


class VectorStage(Stage[VectorStageSettings]):
    name = "vectors"
    poller: zmq.Poller  # made by open()
    poll_ms = 10

    def open(self) -> None:
        settings = self.settings
        self.config = settings.vectors
        started = time.monotonic()
        self.stores = StoreSet(
            stores_root(settings.data_path), self.config.dtype, self.config.shard_bytes
        )
        for name, reason in self.stores.broken.items():
            self.log.error("vector store %s failed recovery and is not served: %s", name, reason)
        self.job_index = JobIndex(settings.data_path)
        self.sink = VectorSink(self.stores, self.job_index.files, self.config.page_items, self.log)
        rows = sum(store.rows for _, store in self.stores.open.values())
        self.log.info(
            "vector stores recovered in %.3f s: %d store(s), %d rows, %d broken; %d job(s) to deliver",
            time.monotonic() - started,
            len(self.stores.open),
            rows,
            len(self.stores.broken),
            len(self.sink.jobs),
        )
        self.flush_s = self.config.flush_ms / 1000
        self.next_flush = time.monotonic() + self.flush_s
        self.next_discover = time.monotonic() + DISCOVER_S
        self.flush_failing = False
        self.flush_failures = 0
        self.searches = 0
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        self.completion = wire.open_socket(self.context, zmq.DEALER)
        secure_client(self.completion, internal_curve(settings))  # the broker's own key
        self.completion.connect(client_address(settings.completion_bind))
        self.pages = wire.Inbox(self.completion, self.log, "completion")  # its RESULT_PAGEs
        self.users = wire.open_socket(self.context, zmq.ROUTER)
        self.users.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # bigger frames: disconnected
        self.limits = wire.WireLimits(max_bytes=MAX_REQUEST_BYTES)
        self.gate.secure(self.users)
        self.users.bind(self.config.bind)  # only now: every store is recovered
        self.poller = zmq.Poller()
        self.poller.register(self.completion, zmq.POLLIN)
        self.poller.register(self.users, zmq.POLLIN)

    # ---- the loop --------------------------------------------------------------------
    def step(self, now: float) -> None:
        events = dict(self.poller.poll(self._wait_ms(now)))
        now = time.monotonic()
        if self.completion in events:
            self._read_pages(now)
        if now >= self.next_flush:
            self._flush(now)
            self.next_flush = now + self.flush_s
        if self.users in events:
            self._read_users()
        if now >= self.next_discover:
            self.next_discover = now + DISCOVER_S
            for job_id in self.sink.discover():
                self.log.info("job %s: delivering its vectors", job_id)
        for meta in self.sink.due(now):
            try:
                wire.send(self.completion, MT.FETCH, meta)
            except FabricError as exc:
                self.log.debug("could not ask completion yet: %s", exc)

    def _wait_ms(self, now: float) -> int:
        """How long to wait for a message: no job to deliver and nothing to flush, until the
        next look for jobs (a user's request still ends the wait), so an idle stage does not
        wake 100 times a second beside the engines; else at most `poll_ms`, to the flush."""
        if not self.sink.jobs and not self.stores.pending():
            return max(0, int((self.next_discover - now) * 1000))
        return max(0, min(self.poll_ms, int((self.next_flush - now) * 1000)))

    def _flush(self, now: float) -> None:
        if not self.stores.pending():
            self.sink.flushed(now)  # pages whose vectors were all stored before
            return
        try:
            self.stores.flush()
        except (FabricError, OSError) as exc:  # a full disk: rows stay queued, nothing acked
            self.flush_failures += 1
            if not self.flush_failing:
                self.log.error("vector flush failed; retrying every flush: %s", exc)
            self.flush_failing = True
            return
        if self.flush_failing:
            self.log.info("vector flush works again")
            self.flush_failing = False
        self.sink.flushed(now)

    def _read_pages(self, now: float) -> None:
        for message in self.pages.read(64):
            if message.type == MT.RESULT_PAGE:
                try:
                    self.sink.on_page(message.meta, message.arrays, now)
                except (KeyError, ValueError, TypeError) as exc:
                    self.log.error("result page for the vector sink dropped: %s", exc)
            elif message.type == MT.ERROR:
                self.log.warning("completion says: %s", message.meta.get("reason"))

    # ---- users -----------------------------------------------------------------------
    def _read_users(self) -> None:
        refuse = lambda route, reason: self._reply(route, MT.ERROR, {"reason": reason})  # noqa: E731
        for message in wire.requests(self.users, 16, self.limits, self.log, "client", refuse):
            try:
                self._user(message)
            except (VectorError, KeyError, ValueError, TypeError) as exc:
                self._reply(message.route, MT.ERROR, {"reason": str(exc)})

    def _user(self, message: wire.Message) -> None:
        meta, route = message.meta, message.route
        if message.type == MT.PING:
            self._reply(route, MT.PONG, {})
        elif message.type == MT.VECTORS_STATS:
            info = self.stats_info()
            if meta.get("job"):  # has this job been delivered in full?
                job_id = str(meta["job"])
                known = JOB_ID.match(job_id) is not None
                info["job_delivered"] = known and (self.sink.delivered_dir / job_id).exists()
            self._reply(route, MT.VECTORS_INFO, info)
        elif message.type == MT.VECTORS_SEARCH:
            self._search(route, meta, message.arrays)
        elif message.type == MT.VECTORS_READ:
            self._read(route, meta)
        else:
            self._reply(route, MT.ERROR, {"reason": f"vectors does not take {message.type.name}"})

    def stats_info(self) -> dict:
        stores = []
        for name, (meta, store) in sorted(self.stores.open.items()):
            files = [p for s in store.shards for p in (s.payload_path, s.ids_path, s.journal_path)]
            stores.append(
                {
                    "name": name,
                    "model": meta.model,
                    "dim": meta.dim,
                    "dtype": meta.dtype,
                    "rows": store.rows,
                    "pending": store.pending_rows,
                    "shards": len(store.shards),
                    "sealed": sum(s.sealed for s in store.shards),
                    "bytes": sum(p.stat().st_size for p in files if p.exists()),
                    "served": True,
                }
            )
        for name, reason in sorted(self.stores.broken.items()):
            stores.append({"name": name, "served": False, "reason": reason})
        jobs = [
            {"job": j.job_id, "stored": j.stored, "errors": j.errors, "skipped": j.skipped}
            for j in self.sink.jobs.values()
        ]
        return {
            "stores": stores,
            "jobs": jobs,
            "delivered_jobs": self.sink.delivered_jobs,
            "flush_failing": self.flush_failing,
            "searches": self.searches,
        }

    def _search(self, route, meta: dict, arrays: dict) -> None:
        store_meta, store = self.stores.get(str(meta["store"]))
        k, metric = int(meta["k"]), str(meta["metric"])
        if not 1 <= k <= MAX_K:
            raise VectorInputError(f"k {k} must be from 1 to {MAX_K}")
        query = np.asarray(arrays.get("query"))
        if len(query) > MAX_QUERIES:  # the rest of the query is checked by search (check_query)
            raise VectorInputError(f"{len(query)} queries; at most {MAX_QUERIES} per search")
        if not store.rows:
            raise VectorInputError(f"store {store_meta.name} holds no durable rows yet")
        started = time.perf_counter()
        scores, refs = search(store, query, k, metric, self.config.search_block_rows)
        self.searches += 1
        custom_ids, jobs, parts, lines = self._names(refs["id"].reshape(-1))
        shape = refs.shape
        self._reply(
            route,
            MT.VECTORS_HITS,
            {
                "store": store_meta.name,
                "model": store_meta.model,
                "custom_ids": custom_ids,
                "jobs": jobs,
                "parts": parts,
                "lines": lines,
                "shape": list(shape),
                "seconds": time.perf_counter() - started,
                "rows": store.rows,
            },
            {
                "scores": np.ascontiguousarray(scores, np.float32),
                "shard": np.ascontiguousarray(refs["shard"]),
                "row": np.ascontiguousarray(refs["row"]),
                "id": np.ascontiguousarray(refs["id"]),
            },
        )

    def _read(self, route, meta: dict) -> None:
        store_meta, store = self.stores.get(str(meta["store"]))
        shard_id, first, count = int(meta["shard"]), int(meta["first"]), int(meta["count"])
        if not 0 <= shard_id < len(store.shards):
            raise VectorInputError(
                f"store {store_meta.name} has shards 0..{len(store.shards) - 1}, not {shard_id}"
            )
        shard = store.shards[shard_id]
        count = max(0, min(count, MAX_READ_ROWS, shard.rows - first))
        ids, rows = store.read(shard_id, first, count)
        custom_ids, jobs, parts, _ = self._names(ids) if meta.get("names") else ([], [], [], [])
        self._reply(
            route,
            MT.VECTORS_ROWS,
            {
                "store": store_meta.name,
                "shard": shard_id,
                "first": first,
                "shard_rows": shard.rows,
                "shards": len(store.shards),
                "dim": store_meta.dim,
                "dtype": store_meta.dtype,
                "model": store_meta.model,
                "custom_ids": custom_ids,
                "jobs": jobs,
                "parts": parts,
            },
            {"ids": np.array(ids), "rows": np.array(rows)},
        )

    def _names(self, ids: np.ndarray) -> tuple[list, list, list, list]:
        """(custom_id, job id, part, line index) of each global id (an item seq: a part p >= 1
        of a line of several parts has its own, collector/vectors/sink.py); None where the job
        is gone."""
        ids = np.asarray(ids, np.uint64)
        job_nos, index = job_of(ids), index_of(ids)
        custom_ids: list = [None] * len(ids)
        jobs: list = [None] * len(ids)
        parts: list = [0] * len(ids)
        lines: list = index.tolist()
        for job_no in np.unique(job_nos).tolist():
            pick = np.flatnonzero(job_nos == job_no)
            job_id = self.job_index.job_id(job_no)
            view = self.job_index.view(job_id) if job_id else None
            if view is None:
                continue
            view.refresh()
            view.take_rejected()  # only custom_ids are wanted here: keep no rejected lines
            line, part = view.lines.owner(index[pick])
            names = view.custom_ids(np.where(line >= 0, line, index[pick]).tolist())
            rows = zip(pick.tolist(), names, part.tolist(), line.tolist(), strict=True)
            for i, name, p, at in rows:
                custom_ids[i], jobs[i], parts[i] = name, job_id, p
                lines[i] = at if at >= 0 else lines[i]
        return custom_ids, jobs, parts, lines

    def _reply(self, route, kind: MT, meta: dict, arrays: dict | None = None) -> None:
        try:
            wire.send(self.users, kind, meta, arrays, route=route)
        except FabricError as exc:
            self.log.debug("could not answer a client: %s", exc)

    def stats(self, now: float) -> dict:
        """Rows per store, rows stored, failed flushes, searches (docs/metrics.md)."""
        return {
            "fabric_vector_rows": {(n,): s.rows for n, (_, s) in self.stores.open.items()},
            "fabric_vector_rows_stored_total": self.sink.rows_stored,
            "fabric_vector_flush_failures_total": self.flush_failures,
            "fabric_vector_searches_total": self.searches,
            "fabric_vector_stores_unserved": len(self.stores.broken),
        }

    # ---- stopping --------------------------------------------------------------------
    def drain(self, deadline: float) -> None:
        """Make queued rows durable and acknowledge their pages; the rest is fetched next life."""
        now = time.monotonic()
        self._flush(now)
        self.completion.setsockopt(zmq.LINGER, 1000)
        for meta in self.sink.due(now + 3600):
            if meta["ack"]:
                try:
                    wire.send(self.completion, MT.FETCH, meta)
                except FabricError:
                    break

    def close(self) -> None:
        self.sink.close()
        self.stores.close()
        self.completion.close(0)
        self.users.close(0)
        self.gate.close()
        self.context.term()
