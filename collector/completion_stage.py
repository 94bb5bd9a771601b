"""The completion stage: results in, durable, inputs retired, workers acknowledged; results out.

Sockets:

| socket            | kind   | peer                                                                 |
|-------------------|--------|----------------------------------------------------------------------|
| `completion` ipc  | PULL   | dispatch: RESULTS (as workers sent them), ITEM_ERRORS (dead letters, quarantined, cancelled) |
| `dispatch` ipc    | PUSH   | dispatch: RETIRED (input slots now DEAD on disk, the worker acks, refused results to hand back) and CANCEL_JOB |
| `completion.bind` | ROUTER | results clients: FETCH / RESULT_PAGE, JOB_STATUS / JOB_INFO, CANCEL / CANCELLED |

Each step takes what arrived, checks each worker result against its item
(collector/result_check.py: a bad one is handed back to dispatch with the
next RETIRED, or stored as the item's error `invalid_result`), stores the
new results (CompletionLog.record, no sync yet), then makes them durable in
one group commit and only then writes the input tombstones (`sync_outputs`). About every
`tombstone_flush_ms` the tombstones are synced and dispatch is told which
slots retired, with the acknowledgements for the workers whose results
those were: output, tombstone, count, retire, acknowledge (invariant 3).

Delivery: a client fetches a page, writes and fsyncs it, and acknowledges
it with its next FETCH (`ack`); only then are those results marked
delivered (invariant 12). One page per job is outstanding; a FETCH without
the ack means the client lost the page, which is sent again (the client's
output files drop what they already hold, so a custom_id is written once).

A full disk (DiskFullError) stops nothing: results that cannot be stored
are not acknowledged (their workers keep them and send them again), item
errors from dispatch (sent once) are kept here, client requests are served
as before, one ERROR line says so, and a store (of the latest results
refused) is tried again every second until one goes through
(pipeline/disk_full.py).
"""

from __future__ import annotations

import collections
import time

import numpy as np
import zmq

from collector.completion_log import (
    ERROR_RESULT,
    TEXT,
    CompletionLog,
    Results,
    flags_of,
    subset,
)
from collector.job_view import JobIndex, JobView, write_cancel
from collector.result_check import CAUSES, HAND_BACK, ResultCheck, expected_for
from gpu.dispatch import forward
from gpu.work_protocol import ITEM_DTYPE
from ingest.jobs import JOB_ID
from pipeline import wire
from pipeline.datadir import DataDir
from pipeline.disk_full import FullDisk
from pipeline.durable import write_whole
from pipeline.errors import DiskFullError, FabricError, SegmentError, WireError
from pipeline.security import ServerGate
from pipeline.segment import Segment, disk_error
from pipeline.stage import Stage
from pipeline.topology import internal_address
from router.shapes import ShapeTable

MT = wire.MessageType
MAX_MESSAGES_PER_STEP = 256
FINISHED_FILE = "finished"


def results_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """What is wrong with the arrays of a RESULTS message (docs/wire.md), or None.

    Every array is one-dimensional with one entry per item (offsets: n + 1 byte
    offsets into the u1 payload, from 0, never decreasing, never past its end),
    so nothing a worker sends can index outside what it sent.
    """
    names = ("items", "status", "kind", "prompt_tokens", "payload", "offsets")
    missing = [name for name in names if name not in arrays]
    if missing:
        return f"arrays {missing} missing"
    if any(arrays[name].ndim != 1 for name in names):
        return "an array is not one-dimensional"
    items, payload, offsets = arrays["items"], arrays["payload"], arrays["offsets"]
    if items.dtype != ITEM_DTYPE:
        return f"items are {items.dtype.descr}, not {ITEM_DTYPE.descr}"
    n = len(items)
    for name in ("status", "kind", "prompt_tokens", "offsets"):
        if arrays[name].dtype.kind not in "ui":
            return f"{name} is {arrays[name].dtype.str}, not integers"
        if len(arrays[name]) != (n + 1 if name == "offsets" else n):
            return f"{name} has {len(arrays[name])} entries for {n} items"
    if payload.dtype != np.uint8:
        return f"payload is {payload.dtype.str}, not u1"
    if offsets[0] != 0 or int(offsets.min()) < 0 or int(offsets.max()) > len(payload):
        return f"offsets do not run from 0 up to at most the {len(payload)} payload bytes"
    if (np.diff(offsets.astype(np.int64)) < 0).any():  # in range: no wrap-around
        return "offsets decrease"
    return None


class CompletionStage(Stage):
    name = "completion"
    poll_ms = 10

    def open(self) -> None:
        settings = self.settings
        self.config = settings.completion
        self.data_dir = DataDir(settings.data_path).ensure()
        self.jobs = JobIndex(settings.data_path)
        self.shapes = ShapeTable(settings.data_path)
        self.inputs: dict[int, Segment] = {}
        self.log_ = CompletionLog(self.data_dir, self._input, expected_items=self._lines_known)
        self.flush_s = self.config.tombstone_flush_ms / 1000
        self.next_flush = time.monotonic() + self.flush_s
        self.next_tidy = time.monotonic() + 1.0
        self.acks: list[list] = []
        self.pages: dict[str, tuple[int, list]] = {}  # job -> (page id, where) awaiting its ack
        self.next_page = 1
        self.rates: dict[str, tuple[float, int]] = {}  # job -> (first seen, completed then)
        self.disk = FullDisk(
            self.log,
            "results are not taken (workers keep them unacknowledged and send them again); "
            "status and results reads go on",
        )
        self.deferred: collections.deque[wire.Message] = collections.deque()  # ITEM_ERRORS
        self.probe: wire.Message | None = None  # the latest RESULTS refused: tried each second
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(internal_address(settings, "completion"))
        self.dispatch = self.context.socket(zmq.PUSH)
        self.dispatch.setsockopt(zmq.LINGER, 2000)
        self.dispatch.setsockopt(zmq.SNDTIMEO, 1000)
        self.dispatch.connect(internal_address(settings, "dispatch"))
        self.clients = self.context.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.SNDTIMEO, 0)
        self.clients.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)  # bigger: dropped
        self.limits = wire.WireLimits(max_bytes=self.config.max_message_bytes)
        self.gate.secure(self.clients)
        self.clients.bind(self.config.bind)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.clients, zmq.POLLIN)
        self.stored = 0
        self.duplicates = 0  # results dropped: their item had one (metrics)
        self.checker = ResultCheck()  # every worker result against its item (trust nothing)
        self.refused = collections.Counter()  # cause -> results refused (metrics)
        self.hand_back: list[tuple[str, int, np.ndarray]] = []  # (session, batch, items): RETIRED
        self.delivered = 0  # results marked delivered (metrics)

    def _input(self, segment_id: int) -> Segment:
        segment = self.inputs.get(segment_id)
        if segment is None:
            paths = list(self.data_dir.segments.glob(f"in-{segment_id:012d}.*.seg"))
            if not paths:
                raise SegmentError(f"input segment {segment_id} does not exist (collected?)")
            segment = Segment.open(paths[0], writable=True)
            self.inputs[segment_id] = segment
        return segment

    # ---- the loop --------------------------------------------------------------------------
    def step(self, now: float) -> None:
        wait_ms = max(0, min(self.poll_ms, int((self.next_flush - now) * 1000)))
        events = dict(self.poller.poll(wait_ms))
        if self.inbox in events or self.deferred or self.probe is not None:
            self._read_inbox(now)
        self._sync_outputs(now)  # outputs durable, then their tombstones written
        now = time.monotonic()
        if now >= self.next_flush:
            self._flush(now)
            self.next_flush = now + self.flush_s
        if self.clients in events:
            self._read_clients(now)
        if now >= self.next_tidy:
            self.next_tidy = now + 1.0
            self._tidy(now)
            self.disk.settle(now)

    def _sync_outputs(self, now: float) -> None:
        if self.log_.unsynced and self.disk.ready(now):
            try:
                self.log_.sync_outputs()
            except DiskFullError as exc:  # everything stays queued for the next try
                self.disk.failed(exc, now)

    def _flush(self, now: float) -> None:
        if self.log_.unsynced:  # outputs not durable yet (a full disk): acknowledge nothing
            return
        try:
            retired = self.log_.flush_tombstones()
        except DiskFullError as exc:  # the tombstones and acks wait for the next flush
            self.disk.failed(exc, now)
            return
        if not retired and not self.acks and not self.hand_back:
            return
        parts = []
        for segment_id, slots in retired.items():
            items = np.zeros(len(slots), ITEM_DTYPE)
            items["segment"] = segment_id
            items["slot"] = slots
            parts.append(items)
        items = np.concatenate(parts) if parts else np.zeros(0, ITEM_DTYPE)
        back = [items for _, _, items in self.hand_back]
        meta = {"acks": self.acks, "refused": [[s, b, len(i)] for s, b, i in self.hand_back]}
        arrays = {"items": items, "refused": np.concatenate(back) if back else items[:0]}
        try:
            wire.send(self.dispatch, MT.RETIRED, meta, arrays)
        except FabricError as exc:  # dispatch restarting: it rereads markers; workers resend
            self.log.warning("could not tell dispatch of %d retired item(s): %s", len(items), exc)
        self.acks = []
        self.hand_back = []

    def _read_inbox(self, now: float) -> None:
        while self.deferred and self._store(self.deferred[0], now):
            self.deferred.popleft()
        if self.probe is not None and self._store(self.probe, now):
            self.probe = None  # the disk takes results again, without waiting for a resend
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                message = forward.recv(self.inbox, 0)  # RESULTS as the worker sent them
            except WireError as exc:
                self.log.error("malformed message from dispatch dropped: %s", exc)
                continue
            if message is None:
                return
            if message.type == MT.ITEM_ERRORS and self.deferred:
                self.deferred.append(message)  # in order, after those waiting for the disk
            elif message.type == MT.ITEM_ERRORS:
                if not self._store(message, now):
                    self.deferred.append(message)  # sent once: kept until the disk takes it
            elif message.type == MT.RESULTS:
                if not self._store(message, now):
                    self.disk.refused()  # not acknowledged: the worker sends them again
                    self.probe = message
            else:
                self.log.error("unexpected %s from dispatch dropped", message.type.name)

    def _store(self, message: wire.Message, now: float) -> bool:
        """Record RESULTS or ITEM_ERRORS; False when the disk is full (then nothing of it is
        acknowledged). A malformed message is dropped (True: it is done with)."""
        if not self.disk.ready(now):
            return False
        try:
            if message.type == MT.RESULTS:
                self._results(message)
            else:
                self._item_errors(message)
        except DiskFullError as exc:
            self.disk.failed(exc, now)
            return False
        except (KeyError, ValueError, TypeError) as exc:
            self.log.error("bad %s message dropped: %s", message.type.name, exc)
            return True
        self.disk.succeeded(now)
        return True

    def _results(self, message: wire.Message) -> None:
        """Store a worker's results; acknowledged at the next flush. DiskFullError: not
        acknowledged (what was stored of it is a duplicate when the worker sends it again)."""
        meta, a = message.meta, message.arrays
        ack = [meta.get("route", ""), meta["result_id"], 0]
        self.acks.append(ack)
        problem = results_problem(a)
        if problem is not None:
            self.log.error(
                "results from session %s are malformed (%s); dropped", meta["session"], problem
            )
            return
        items, payload, offsets = a["items"], a["payload"], a["offsets"].astype(np.int64)
        ack[2] = len(items)
        expected, attempts = expected_for(items, self._input, self.shapes)
        verdict = self.checker.check(expected, a["status"], a["kind"], payload, offsets)
        error = a["status"] == ERROR_RESULT  # the worker's own error: stored as text
        status = flags_of(error, np.where(error, TEXT, a["kind"].astype(np.uint32) & 0xF))
        prompt = a["prompt_tokens"].astype(np.uint32)
        good = np.flatnonzero(verdict.cause == 0)
        try:
            if len(good) < len(items):
                sub_payload, sub_offsets = subset(payload, offsets, good)
            else:
                sub_payload, sub_offsets = payload, offsets
            why = "sent again" if meta.get("resent") else "computed again"
            known = self._record(
                items[good], status[good], sub_payload, sub_offsets, prompt[good], why
            )
            back = (
                self._refuse(meta["session"], items, verdict, attempts)
                if len(good) < len(items)
                else None
            )
            if not known:  # not acknowledged: the worker sends them again, the rest are duplicates
                self.acks.pop()
            elif back is not None and len(back):
                batch_id = meta.get("batch_id")  # a worker's word: used only to find its lease
                batch_id = batch_id if isinstance(batch_id, int) and batch_id >= 0 else 0
                self.hand_back.append((str(meta["session"]), batch_id, back))
        except DiskFullError:
            self.acks.pop()  # this message's ack, appended last: the worker sends them again
            raise

    def _refuse(self, session, items, verdict, attempts) -> np.ndarray:
        """Results that failed their check (collector/result_check.py): stored as the item's
        error `invalid_result` (not finite, or refused on its last attempt), or returned to be
        handed back to dispatch with the next RETIRED (counting an attempt)."""
        last = attempts + 1 >= self.settings.dispatch.max_attempts
        back = []
        for cause in np.unique(verdict.cause[verdict.cause != 0]).tolist():
            mine = verdict.cause == cause
            self.refused[CAUSES[cause]] += int(mine.sum())
            errors = mine & (last | (cause not in HAND_BACK))
            if errors.any():
                self._errors(items[errors], verdict.reason(cause))
            back.append(items[mine & ~errors])
            self.log.warning(
                "session %s: %d result(s) refused (%s: %s): %d stored as errors, %d handed back",
                session,
                int(mine.sum()),
                CAUSES[cause],
                verdict.detail.get(cause, ""),
                int(errors.sum()),
                int((mine & ~errors).sum()),
            )
        return np.concatenate(back) if back else items[:0]

    def _item_errors(self, message: wire.Message) -> None:
        self._errors(message.arrays["items"], str(message.meta["reason"]))

    def _errors(self, items: np.ndarray, text: str) -> None:
        """Store one error result, `text` ("code: message"), for each of `items`."""
        reason = text.encode("utf-8")
        n = len(items)
        payload = np.frombuffer(reason * n, np.uint8)
        offsets = np.arange(n + 1, dtype=np.int64) * len(reason)
        status = np.full(n, flags_of(ERROR_RESULT, TEXT), np.uint32)
        self._record(items, status, payload, offsets, np.zeros(n, np.uint32))

    def _lines_known(self, job_id: str) -> int:
        """Lines of the job committed so far, as last read (sizes its completion segments)."""
        view = self.jobs.views.get(job_id)
        return 0 if view is None else view.stored + view.rejected_count

    def _record(self, items, status, payload, offsets, prompt, why: str = "computed again") -> bool:
        """Store results; False if some name a job number this broker does not know (yet)."""
        known = True
        job_nos = items["seq"] >> np.uint64(32)
        for job_no in np.unique(job_nos).tolist():
            pick = np.flatnonzero(job_nos == job_no)
            job_id = self.jobs.job_id(int(job_no))
            if job_id is None:
                self.log.error(
                    "%d result(s) for unknown job number %d not stored or acknowledged",
                    len(pick),
                    job_no,
                )
                known = False
                continue
            if len(pick) == len(items):
                sub_payload, sub_offsets = payload, offsets
            else:
                sub_payload, sub_offsets = subset(payload, offsets, pick)
            recorded = self.log_.record(
                Results(
                    job_id,
                    int(job_no),
                    items["segment"][pick],
                    items["slot"][pick],
                    items["seq"][pick],
                    status[pick],
                    sub_payload,
                    sub_offsets,
                    prompt[pick],
                ),
                sync=False,
            )
            self.stored += recorded.stored
            self.duplicates += recorded.duplicates
            if recorded.duplicates:
                self.log.info(
                    "job %s: %d duplicate result(s) dropped (%s)", job_id, recorded.duplicates, why
                )
            for line in recorded.refused[:5]:
                self.log.warning("job %s: result refused: %s", job_id, line)
        return known

    # ---- clients -------------------------------------------------------------------------
    def _read_clients(self, now: float) -> None:
        refuse = lambda route, reason: self._reply(route, MT.ERROR, {"reason": reason})  # noqa: E731
        for message in wire.requests(self.clients, 64, self.limits, self.log, "client", refuse):
            try:
                self._client(message, now)
            except (KeyError, ValueError, TypeError) as exc:
                self._reply(message.route, MT.ERROR, {"reason": f"bad request: {exc}"})
            except FabricError as exc:  # a cancel mark not written (a full disk: ask again)
                retryable = isinstance(exc, DiskFullError)
                if retryable:
                    self.disk.failed(exc, now)
                else:
                    self.log.error("a %s request failed: %s", message.type.name, exc)
                flags = wire.Flag.RETRYABLE if retryable else 0
                self._reply(message.route, MT.ERROR, {"reason": str(exc)}, flags=flags)

    def _client(self, message: wire.Message, now: float) -> None:
        meta, route = message.meta, message.route
        if message.type == MT.PING:
            self._reply(route, MT.PONG, {})
            return
        if message.type not in (MT.FETCH, MT.JOB_STATUS, MT.CANCEL):
            self._reply(
                route, MT.ERROR, {"reason": f"completion does not take {message.type.name}"}
            )
            return
        job_id = str(meta["job"])
        if not JOB_ID.match(job_id):  # never a path outside jobs/ ("../x", "/etc")
            self._reply(route, MT.ERROR, {"reason": f"job id {job_id!r} is not allowed"})
            return
        try:
            view = self.jobs.view(job_id)
        except (FabricError, OSError, ValueError) as exc:
            view = None
            self.log.warning("job %r unreadable: %s", job_id, exc)
        if view is None:
            self._reply(route, MT.ERROR, {"reason": f"no job {job_id!r} on this broker"})
            return
        self._catch_up(view, now)
        if message.type == MT.JOB_STATUS:
            self._reply(route, MT.JOB_INFO, self._job_info(view, now))
        elif message.type == MT.CANCEL:
            info = self._job_info(view, now)
            if info["state"] in ("completed", "expired"):
                self._reply(route, MT.ERROR, {"reason": f"job {job_id} is already {info['state']}"})
                return
            if not view.cancelled:
                try:
                    write_cancel(view)
                except OSError as exc:
                    raise disk_error(exc, view.cancel_path, "recording a cancel") from exc
                self.log.info("job %s cancelled by a client", job_id)
            try:  # again on every request: dispatch may have restarted (it also reads the mark)
                wire.send(self.dispatch, MT.CANCEL_JOB, {"job_no": view.job_no})
            except FabricError as exc:
                self.log.warning("could not tell dispatch of the cancel yet: %s", exc)
            info = self._job_info(view, now)
            self._reply(route, MT.CANCELLED, {**info, "state": info["state"]})
        else:
            self._fetch(route, view, meta, now)

    def _catch_up(self, view: JobView, now: float) -> None:
        """Read what the front appended; rejected lines become error results.

        Not once the job has finished: its results may be collected by then, and
        the rejected lines were stored before it could finish. On a full disk the
        rejected lines stay in the view for a later try.
        """
        view.refresh()
        if not view.rejected:
            return
        if (view.directory / FINISHED_FILE).exists():
            view.take_rejected()
            return
        if not self.disk.ready(now):
            return
        rejected = view.take_rejected()
        index = np.array([int(r[0]) - 1 for r in rejected], np.int64)
        reasons = [f"{r[2]}: {r[3]}" for r in rejected]
        try:
            self.log_.record_errors(view.job_id, view.job_no, index, reasons)
            self.log_.sync_outputs()
        except DiskFullError as exc:  # those stored are skipped as duplicates next time
            view.rejected[:0] = rejected
            self.disk.failed(exc, now)

    def _state(self, view: JobView, done: int, total: int | None) -> str:
        if total is None:
            return "validating"
        if done >= total:
            return "cancelled" if view.cancelled else "completed"
        if view.cancelled:
            return "cancelling"
        return "in_progress" if done else "queued"

    def _job_info(self, view: JobView, now: float) -> dict:
        job_id = view.job_id
        done = self.log_.completed(job_id)
        failed = self.log_.failed(job_id)
        total = view.total
        undelivered = self.log_.undelivered(job_id)
        if (
            (view.directory / FINISHED_FILE).exists()
            and total is not None
            and done < total
            and not undelivered
        ):
            state = "expired"  # finished once; its delivered results are past retention, removed
        else:
            state = self._state(view, done, total)
        # results of work done: not error results (a cancel's, rejected lines') that come at once
        first = self.rates.setdefault(job_id, (now, done - failed))
        elapsed = now - first[0]
        rate = max(0, done - failed - first[1]) / elapsed if elapsed > 1 else 0.0
        pending = None if total is None else max(0, total - done)
        if state in ("completed", "cancelled") and not (view.directory / FINISHED_FILE).exists():
            self._finish(view, now)
        return {
            "job": job_id,
            "job_no": view.job_no,
            "exists": True,
            "state": state,
            "total": total,
            "completed": done - failed,
            "failed": failed,
            "pending": pending,
            "undelivered": undelivered,
            "created_ns": view.created_ns,
            "deliver": view.deliver,
            "rate": round(rate, 1),
            "eta_s": round(pending / rate, 1) if rate > 0 and pending else None,
        }

    def _fetch(self, route, view: JobView, meta: dict, now: float) -> None:
        job_id = view.job_id
        everything = bool(meta.get("all", False))
        if view.deliver != "file" and not everything and meta.get("sink") != "vectors":
            self._reply(
                route,
                MT.ERROR,
                {
                    "reason": f"job {job_id} delivers its results to the vector store "
                    f"({view.deliver}); read them with `results {job_id} --all` (until "
                    "retention ends) or `python run.py vectors search/export`"
                },
            )
            return
        outstanding = self.pages.pop(job_id, None)
        if outstanding is not None and meta.get("ack") == outstanding[0]:
            try:
                self.delivered += self.log_.delivered(job_id, outstanding[1])
            except DiskFullError as exc:  # marked in memory; made durable by a later sync
                self.disk.failed(exc, now)
        limit = max(1, min(int(meta.get("limit", self.config.page_items)), 65536))
        cursors = (  # a negative cursor would count from a segment's end
            {int(s): max(0, int(k)) for s, k in meta.get("cursors", [])} if everything else None
        )
        page = self.log_.page(job_id, limit, cursors, everything)
        info = self._job_info(view, now)
        page_id = 0
        if len(page) and not everything:
            page_id = self.next_page
            self.next_page += 1
            self.pages[job_id] = (page_id, page.where)
        models = {
            int(m): (self.log_.models.get(int(m)) or {}).get("model", "")
            for m in np.unique(page.model).tolist()
        }
        shapes = {int(s): self.shapes.get(int(s)) or {} for s in np.unique(page.shape).tolist()}
        reply = {
            **info,
            "page": page_id,
            "custom_ids": view.custom_ids(page.index.tolist()),
            "models": {str(k): v for k, v in models.items()},
            "shapes": {str(k): v for k, v in shapes.items()},
            "cursors": [[s, k] for s, k in page.next.items()],
            "req": meta.get("req", 0),  # echoed: a sink tells a stale answer from the current one
        }
        self._reply(
            route,
            MT.RESULT_PAGE,
            reply,
            {
                "index": page.index,
                "status": page.status,
                "kind": page.kind,
                "model": page.model,
                "shape": page.shape,
                "prompt_tokens": page.prompt_tokens,
                "payload": page.payload,
                "offsets": page.offsets,
            },
        )

    def stats(self, now: float) -> dict:
        """Results stored, duplicates dropped, results delivered (docs/metrics.md)."""
        return {
            "fabric_items_completed_total": self.stored,
            "fabric_duplicate_results_total": self.duplicates,
            "fabric_results_delivered_total": self.delivered,
            "fabric_results_refused_total": {(c,): self.refused[c] for c in CAUSES[1:]},
        }

    def _reply(
        self, route, kind: MT, meta: dict, arrays: dict | None = None, flags: int = 0
    ) -> None:
        try:
            wire.send(self.clients, kind, meta, arrays, route=route, flags=flags)
        except FabricError as exc:
            self.log.debug("could not answer a client: %s", exc)

    # ---- housekeeping --------------------------------------------------------------------
    def _tidy(self, now: float) -> None:
        """Release finished input segments; finish jobs whose every item has a result."""
        for segment_id, segment in list(self.inputs.items()):
            if segment.sealed and segment.deleted >= segment.entries:
                segment.close()
                del self.inputs[segment_id]
        for job_id in self.log_.known_jobs():
            view = self.jobs.view(job_id)
            if view is None:
                continue
            if (view.directory / FINISHED_FILE).exists():
                if job_id not in self.pages and not self.log_.undelivered(job_id):
                    self.log_.unload(job_id)  # all delivered: free its bitmaps and handles
                    self.jobs.forget(job_id)
                continue
            self._catch_up(view, now)
            total = view.total
            if total is not None and self.log_.completed(job_id) >= total:
                self._finish(view, now)

    def _finish(self, view: JobView, now: float) -> None:
        """Seal the job's completion segments and note when it finished (for retention);
        on a full disk, again at the next tidy."""
        path = view.directory / FINISHED_FILE
        try:
            self.log_.finish_job(view.job_id)
            try:  # whole or absent: an empty mark would read as finished at time 0
                write_whole(path, f"{time.time_ns()}\n".encode())
            except OSError as exc:
                raise disk_error(exc, path, "noting that the job finished") from exc
        except DiskFullError as exc:
            self.disk.failed(exc, now)
            return
        self.log.info("job %s finished", view.job_id)

    def drain(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            events = dict(self.poller.poll(20))
            if self.inbox not in events:
                break
            now = time.monotonic()
            self._read_inbox(now)
            self._sync_outputs(now)
        now = time.monotonic()
        self.disk.next_try = now  # one last try each
        self._sync_outputs(now)
        self._flush(now)
        if self.log_.unsynced or self.deferred:
            self.log.error(
                "stopping on a full disk: results not stored are sent again by their workers; "
                "%d item error batch(es) not stored (their items stay queued; dispatch meets "
                "them again after a restart)",
                len(self.deferred),
            )

    def close(self) -> None:
        try:
            self.log_.close()
        except DiskFullError as exc:  # seals not durable: recovery finds them open, harmless
            self.log.error("closing the completion log: %s", exc)
        for segment in self.inputs.values():
            segment.close()
        self.inbox.close(0)
        self.dispatch.close()
        self.clients.close(0)
        self.gate.close()
        self.context.term()
