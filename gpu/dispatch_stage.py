"""The dispatch stage: one owner of all dispatch state, between the segment log and GPU workers.

Sockets (docs/dispatch.md has the message table):

| socket           | kind   | peer                                                        |
|------------------|--------|-------------------------------------------------------------|
| `dispatch.bind`  | ROUTER | workers (WORKER_HELLO, WORK_REQUEST, REPORT, RESULTS, HAND_BACK, BYE) and `status` clients (BROKER_STATUS) |
| `dispatch` ipc   | PULL   | writers (APPENDED) and the completion stage (RETIRED, CANCEL_JOB) |
| `completion` ipc | PUSH   | the completion stage: RESULTS forwarded as they came (less the work token), ITEM_ERRORS |

The owner thread runs `step()`: it reads what arrived, answers workers,
expires leases and silent sessions (only after loading: invariant 9), sends
dead letters, quarantined and cancelled items to the completion stage as
error results, and hands the dispatch file its entries. ZeroMQ's own I/O
thread moves the bytes; the dispatch file is written and synced on its own
thread (gpu/dispatch_files.py).

Work is learnt three ways: the segment files found at start (every LIVE
slot, invariant 4), the writers' APPENDED descriptors (after their fsync),
and a rescan of the segment directory every second (a descriptor lost
while this stage restarted is found there). Segments queued before this
start are held back for `reregister_grace_s`, so that workers that still
hold some of their items re-register first (invariant 8); a restarted
stage also reloads its dispatch file (same epoch, invariant 11).

Each batch goes out with a work token (gpu/work_token.py); RESULTS and the
claims of a WORKER_HELLO are taken only from a registered session, for
items a token of this data dir covers.
"""

from __future__ import annotations

import collections
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from gpu.arrivals import Arrivals
from gpu.dispatch_files import DispatchFile
from gpu.dispatch_report import CORRUPT_INPUT, DEAD_LETTER, broker_status, dispatch_metrics
from gpu.dispatch_stall import StallWatch
from gpu.dispatch_state import Batch, DispatchState
from gpu.work_protocol import ITEM_DTYPE
from gpu.work_token import Refusals, WorkTokens
from pipeline import wire
from pipeline.counter import DurableCounter
from pipeline.datadir import DataDir
from pipeline.disk_full import FullDisk
from pipeline.errors import DiskFullError, FabricError, WireError
from pipeline.salvage import isolated_files
from pipeline.scan import SegmentSummary, scan_segment
from pipeline.security import ServerGate
from pipeline.segment import Segment
from pipeline.stage import EPOCH_ENV, Stage
from pipeline.topology import internal_address
from router.intern_table import InternTable

MT = wire.MessageType
PARK_S = 0.5  # a work request with nothing to give waits this long before NO_WORK
RESCAN_S = 1.0
RECENT_DEAD_LETTERS = 20  # dead-letter events kept for BROKER_STATUS
MAX_MESSAGES_PER_STEP = 512
ITEM_ERRORS_RESEND_S = 5.0  # item errors not seen retired this long after sending go again
BATCH_IDS_FILE = "next-batch-id"  # DurableCounter in the data dir: batch ids never reused
BATCH_ID_BLOCK = 1 << 20  # batch ids reserved at a time
MAX_WAITING_FOR_COMPLETION = 2048  # forwarded result batches held while completion is away
CANCELLED = "cancelled"


def item_array(message: wire.Message, name: str) -> np.ndarray:
    """The message's `name` array of (segment, slot, seq) items, empty if absent.

    ValueError (answered with ERROR) unless it is one-dimensional ITEM_DTYPE: a
    worker's arrays are checked here, before any of them indexes a segment.
    """
    items = message.arrays.get(name)
    if items is None:
        return np.zeros(0, ITEM_DTYPE)
    if items.dtype != ITEM_DTYPE or items.ndim != 1:
        raise ValueError(
            f"array {name!r} is {items.dtype.descr} x {list(items.shape)}, "
            f"not one-dimensional {ITEM_DTYPE.descr}"
        )
    return items


def slot_keys(items: np.ndarray) -> np.ndarray:
    """One u8 per item naming its (segment, slot): what a RETIRED item is matched by."""
    return (items["segment"].astype(np.uint64) << np.uint64(32)) | items["slot"].astype(np.uint64)


def worker_figures(meta: dict) -> dict[str, float]:
    """What a worker's REPORT says about itself (prompt_tokens, tokens_per_s, idle_s; totals
    since the worker started); a missing or malformed figure is left out."""
    figures = {}
    for key in ("prompt_tokens", "tokens_per_s", "idle_s"):
        value = meta.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and value >= 0:
            figures[key] = float(value)
    return figures


def broker_epoch() -> int:
    """The epoch of this broker life, set by the supervisor (0 when run alone)."""
    try:
        return int(os.environ.get(EPOCH_ENV, "0"))
    except ValueError:
        return 0


@dataclass
class _Session:
    route: bytes
    model: str
    last_seen: float
    handed_out: int = 0
    retired: int = 0
    started: float = field(default_factory=time.monotonic)
    idle_s: float = 0.0  # the worker's own time waiting for work, from its last REPORT
    idle_marks: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=11)
    )  # (t, idle_s), one per rescan tick
    reported: dict = field(default_factory=dict)  # the worker's own figures from its last REPORT


@dataclass
class _Parked:
    route: tuple[bytes, ...]
    session: str
    model: str
    max_items: int
    max_tokens: int
    until: float


class DispatchStage(Stage):
    name = "dispatch"
    poll_ms = 20

    def open(self) -> None:
        settings = self.settings
        config = settings.dispatch
        self.config = config
        self.data_dir = DataDir(settings.data_path).ensure()
        self.epoch = broker_epoch()
        self.state = DispatchState(config.lease_s, config.max_attempts)
        self.tokens = WorkTokens.of_data_dir(self.data_dir.root)  # gpu/work_token.py
        self.refused = Refusals(self.log)  # results, claims: refused for want of a token
        self.stall = StallWatch(config.stall_batch_multiple, config.stall_min_s)  # no progress
        # Batch ids grow across restarts and broker lives, so a worker's `seen_batch` from an
        # earlier life never covers a batch of this one: blocks of ids are reserved durably
        # (at least microseconds since the epoch), so a wall clock stepped back cannot reuse one.
        self.batch_ids = DurableCounter(self.data_dir.root / BATCH_IDS_FILE)
        self.disk = FullDisk(self.log, "no new batches until batch ids can be reserved")
        self.batch_ids_end = 0
        self._reserve_batch_ids()
        self.shapes = InternTable(settings.data_path)
        self.sessions: dict[str, _Session] = {}
        self.parked: collections.deque[_Parked] = collections.deque()
        self.to_completion: collections.deque[tuple[MT, dict, dict]] = collections.deque()
        # Item errors (dead letters, quarantined, cancelled) are sent once and nothing else
        # holds them: kept here, [resend at, reason, items not yet seen retired], until
        # completion's RETIRED names them, and sent again if it does not (completion lost
        # them to a kill before they were durable; it drops what it already has).
        self.unretired_errors: list[list] = []
        self.counts = collections.Counter()
        self.dispatched = collections.Counter()  # model -> items handed out (metrics)
        self.reclaimed = collections.Counter()  # cause -> items put back in the queue (metrics)
        self.arrivals = Arrivals()  # when queued slots became durable: the queue's age
        self._recorded: set[int] = set()  # lease ids written to the dispatch file
        self.samples: collections.deque = collections.deque(maxlen=11)  # (t, out, retired)
        self.dead_letters: collections.deque[dict] = collections.deque(maxlen=RECENT_DEAD_LETTERS)
        now = time.monotonic()
        grace_until = now + config.reregister_grace_s
        self._scanned: set[int] = set()
        self.damaged: dict[str, str] = {}  # file name -> what is wrong (status, metrics)
        self._notified: dict[int, float] = {}  # segment -> last APPENDED notice (monotonic)
        self._rescan(not_before=grace_until)
        self.next_rescan = now + RESCAN_S
        (self.data_dir.root / "dispatch").mkdir(exist_ok=True)
        self.file, leases = DispatchFile.open(
            self.data_dir.root / "dispatch" / "inflight.log", self.epoch
        )
        for lease in leases:
            held = self.state.adopt(lease.session, lease.items, now, batch_id=lease.batch_id)
            self._recorded.add(lease.batch_id)
            if (held == 1).any() and lease.session not in self.sessions:
                self.sessions[lease.session] = _Session(lease.session.encode(), "", now)
                self.stall.registered(lease.session, now)
        if leases:
            self.log.info(
                "reloaded %d lease(s) of %d session(s) from the dispatch file (epoch %d)",
                len(leases),
                len(self.sessions),
                self.epoch,
            )
        for cancel in (self.data_dir.root / "jobs").glob("*/cancel"):
            if (cancel.parent / "finished").exists():
                continue  # nothing of it is queued any more
            try:
                self.state.cancelled_jobs.add(int(cancel.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                self.log.warning("unreadable cancel mark %s; ignored", cancel)
        self.state.loaded()  # lease and session timeouts count from here (invariant 9)
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        self.workers = self.context.socket(zmq.ROUTER)
        self.workers.setsockopt(zmq.LINGER, 0)
        self.workers.setsockopt(zmq.SNDTIMEO, 0)
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting session takes its id back
        self.workers.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)  # bigger: disconnected
        self.limits = wire.WireLimits(max_bytes=config.max_message_bytes)
        self.gate.secure(self.workers)
        self.workers.bind(settings.dispatch.bind)
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(internal_address(settings, "dispatch"))
        self.completion = self.context.socket(zmq.PUSH)
        self.completion.setsockopt(zmq.LINGER, 2000)
        self.completion.setsockopt(zmq.SNDTIMEO, 0)
        self.completion.setsockopt(zmq.SNDHWM, 10_000)
        self.completion.connect(internal_address(settings, "completion"))
        self.poller = zmq.Poller()
        self.poller.register(self.workers, zmq.POLLIN)
        self.poller.register(self.inbox, zmq.POLLIN)
        self.log.info(
            "dispatch up: %d segment(s) with work, epoch %d, grace %.1f s",
            len(self.state.queued_segments()),
            self.epoch,
            config.reregister_grace_s,
        )

    # ---- segments --------------------------------------------------------------------------
    def _rescan(self, not_before: float = 0.0) -> None:
        """Open input segments not known yet; refresh the written end of known ones."""
        for path in isolated_files(self.data_dir):  # moved aside at start (pipeline/salvage.py)
            self.damaged.setdefault(path.name, "isolated in damaged/")
        for path in sorted(self.data_dir.segments.glob("in-*.seg")):
            try:
                segment_id = int(path.name[3:15])
            except ValueError:
                continue
            if self.state.knows(segment_id) or segment_id in self._scanned:
                continue
            self._load(path, not_before)
        now = time.monotonic()
        for segment in self.state.segments():  # a notice lost while this stage was down
            if now - self._notified.get(segment.segment_id, 0.0) > 2 * RESCAN_S:
                self.state.extend(segment.segment_id, segment.entries)
                self.arrivals.seen(segment.segment_id, segment.entries, time.time())

    def _load(self, path, not_before: float) -> None:
        summary = scan_segment(path)
        if not isinstance(summary, SegmentSummary):  # damaged: isolated at the next start
            self.log.error("not dispatching from %s: %s", path, summary.reason)
            self.damaged[path.name] = summary.code
            self._scanned.add(int(path.name[3:15]))
            return
        if summary.first_live < 0 and summary.sealed:
            self._scanned.add(summary.header.segment_id)  # finished: the collector's
            return
        try:
            segment = Segment.open(path, writable=True)
        except (FabricError, OSError) as exc:
            self.log.error("cannot open %s for dispatch: %s", path, exc)
            return
        shape = self.shapes.get(segment.key.shape) if segment.key.shape else None
        priority = int((shape or {}).get("priority", 0) or 0)
        first = summary.first_live if summary.first_live >= 0 else summary.end
        self.state.add_segment(
            segment, first, max(summary.end, segment.entries), priority, not_before
        )
        created_s = segment.header.created_ns / 1e9  # found on disk: as old as its segment
        self.arrivals.seen(segment.segment_id, max(summary.end, segment.entries), created_s)

    def _appended(self, segment_id: int, end: int) -> None:
        if not self.state.knows(segment_id):
            for path in self.data_dir.segments.glob(f"in-{segment_id:012d}.*.seg"):
                self._load(path, 0.0)
        if self.state.knows(segment_id):
            self._notified[segment_id] = time.monotonic()
            self.state.extend(segment_id, end)
            self.arrivals.seen(segment_id, end, time.time())
            self.counts["appended_notices"] += 1

    # ---- the loop --------------------------------------------------------------------------
    def step(self, now: float) -> None:
        timeout = 0 if self.to_completion else self.poll_ms
        if self.parked:
            timeout = min(timeout, 5)
        events = dict(self.poller.poll(timeout))
        if self.inbox in events:
            self._read_inbox()
            self.state.sweep_cancelled()  # work that just arrived for a cancelled job
        if self.workers in events:
            self._read_workers(now)
        self._serve_parked(now)
        self._timeouts(now)
        self._outcomes()
        self._flush_to_completion()
        self._record_ended()
        self.file.maybe_sync(now)
        if now >= self.next_rescan:
            self.next_rescan = now + RESCAN_S
            self.samples.append((now, self.counts["handed_out"], self.counts["retired"]))
            for session in self.sessions.values():
                session.idle_marks.append((now, session.idle_s))
            self._rescan()
            self._resend_item_errors(now)
            self._reclaim_stalled(now)
            self.state.sweep_cancelled()
            for segment_id, _, _, _, _, floor in self.state.backlog():
                self.arrivals.forget_below(segment_id, floor)  # marks no slot can need again
            for segment in self.state.forget_finished():
                self.arrivals.forget(segment.segment_id)
                self.log.info("segment %d finished; released", segment.segment_id)
                segment.close()
            if self.file.garbage_ratio > 0.75 and self.file.file_bytes > 1 << 20:
                self.file.compact(self._live_leases())

    def _read_inbox(self) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                message = wire.recv(self.inbox, 0)
            except WireError as exc:
                self.log.error("malformed internal message dropped: %s", exc)
                continue
            if message is None:
                return
            meta = message.meta
            if message.type == MT.APPENDED:
                self._appended(int(meta["segment"]), int(meta["end"]))
            elif message.type == MT.RETIRED:
                self._retired(message)
            elif message.type == MT.CANCEL_JOB:
                taken = self.state.cancel_job(int(meta["job_no"]))
                self.log.info("job %d cancelled: %d queued item(s) taken", meta["job_no"], taken)
            else:
                self.log.error("unexpected internal message %s dropped", message.type.name)

    def _retired(self, message: wire.Message) -> None:
        items = message.arrays.get("items")
        if items is not None and len(items):
            for segment_id in np.unique(items["segment"]).tolist():
                slots = items["slot"][items["segment"] == segment_id].astype(np.int64)
                self.state.retired(int(segment_id), slots)
            self.counts["retired"] += len(items)
            retired = slot_keys(items)  # RETIRED names slots (its seqs are 0): match by slot
            for entry in self.unretired_errors:  # segment ids are never reused
                entry[2] = entry[2][~np.isin(slot_keys(entry[2]), retired)]
            self.unretired_errors = [e for e in self.unretired_errors if len(e[2])]
        refused, at = message.arrays.get("refused"), 0
        for session, batch_id, count in (
            message.meta.get("refused", ()) if refused is not None else ()
        ):
            self._refused(str(session), int(batch_id), refused[at : at + count])
            at += count
        for route_hex, result_id, count in message.meta["acks"]:
            route = bytes.fromhex(route_hex)
            session = self.sessions.get(route.decode("ascii", "replace"))
            if session is not None:
                session.retired += int(count)
            self._send(route, MT.RESULTS_ACK, {"result_ids": [result_id]})

    def _refused(self, session: str, batch_id: int, items: np.ndarray) -> None:
        """Completion refused these results of the session's batch (collector/result_check.py):
        reclaim them counting an attempt, before the worker's ack goes out."""
        batch = self.state.lease(batch_id)
        if batch is None or batch.session != session:
            return  # reclaimed meanwhile (a lease expiry, a lost session): counted then
        slots = items["slot"][items["segment"] == batch.segment_id].astype(np.int64)
        back = self.state.reclaim(batch_id, count_attempt=True, slots=slots)
        self.reclaimed["result_refused"] += back
        self.log.info("session %s: %d item(s) reclaimed, their results refused", session, back)

    def _read_workers(self, now: float) -> None:
        refuse = lambda route, reason: self._send(route[0], MT.ERROR, {"reason": reason})  # noqa: E731
        for message in wire.requests(
            self.workers, MAX_MESSAGES_PER_STEP, self.limits, self.log, "worker", refuse
        ):
            try:
                self._handle(message, now)
            except (KeyError, ValueError, TypeError) as exc:
                self.log.warning("bad %s message refused: %s", message.type.name, exc)
                self._send(message.route[0], MT.ERROR, {"reason": f"bad message: {exc}"})

    def _handle(self, message: wire.Message, now: float) -> None:
        meta, route = message.meta, message.route[0]
        kind = message.type
        if kind == MT.BROKER_STATUS:
            self._send(route, MT.BROKER_INFO, broker_status(self, now))
            return
        if kind == MT.PING:
            self._send(route, MT.PONG, {"epoch": self.epoch})
            return
        session_id = meta.get("session")
        if not isinstance(session_id, str) or route != session_id.encode():
            self._send(
                route, MT.ERROR, {"reason": "a worker's socket identity must be its session"}
            )
            return
        if kind == MT.WORKER_HELLO:
            self._hello(message, session_id, now)
            return
        session = self.sessions.get(session_id)
        if kind == MT.RESULTS and session is None:  # it re-registers, then sends them again
            self.refused.add("results", session_id, "the session is not registered")
        if session is None:
            self._send(route, MT.UNKNOWN_SESSION, {"session": session_id})
            return
        session.last_seen = now
        if kind == MT.RESULTS:
            self._results(message, session_id, now)
            return
        if kind == MT.WORK_REQUEST:
            request = _Parked(
                message.route,
                session_id,
                str(meta["model"]),
                max(1, int(meta["max_items"])),
                max(1, int(meta["max_tokens"])),
                now + PARK_S,
            )
            if not self._serve(request, now):  # one parked request per session: the latest
                self.parked = collections.deque(p for p in self.parked if p.session != session_id)
                self.parked.append(request)
        elif kind == MT.REPORT:
            held = item_array(message, "held")
            self.reclaimed["missing_from_report"] += self.state.report(
                session_id, held, int(meta["seen_batch"]), now, meta.get("queued", ())
            )
            session.reported = worker_figures(meta)
            session.idle_s = session.reported.get("idle_s", session.idle_s)
        elif kind == MT.HAND_BACK:
            self._hand_back(
                session_id,
                item_array(message, "items"),
                str(meta["reason"]),
                bool(meta.get("count_attempt", False)),
            )
        elif kind == MT.BYE:
            back = self.state.drop_session_quietly(session_id)
            self.reclaimed["worker_left"] += back
            self.sessions.pop(session_id, None)
            self.stall.forget(session_id)
            self.log.info("session %s said goodbye (%d item(s) handed back)", session_id, back)
        else:
            self._send(route, MT.ERROR, {"reason": f"dispatch does not take {kind.name}"})

    def _hello(self, message: wire.Message, session_id: str, now: float) -> None:
        held = item_array(message, "held")
        model = str(message.meta["model"])
        self.sessions[session_id] = _Session(session_id.encode(), model, now)
        self.stall.registered(session_id, now)
        proven, failed = self.tokens.covered(
            session_id, message.meta.get("tokens"), item_array(message, "issued"), held
        )
        if failed or not proven.all():  # never handed to it by this data dir: answered 0
            self.refused.add(
                "claims",
                session_id,
                f"{int((~proven).sum())} of {len(held)} claimed item(s) are in no batch whose "
                f"work token verifies ({failed} token(s) failed)",
            )
        known = np.zeros(len(held), np.uint8)
        known[proven] = self.state.adopt(session_id, held[proven], now)
        self.log.info(
            "session %s (model %s) registered holding %d item(s): %d still live",
            session_id,
            model,
            len(held),
            int((known > 0).sum()),
        )
        for batch in self.state.leases(session_id):
            if batch.batch_id not in self._recorded:
                self.file.lease(batch.batch_id, session_id, batch.items)
                self._recorded.add(batch.batch_id)
        self._send(
            session_id.encode(),
            MT.WELCOME,
            {
                "epoch": self.epoch,
                "lease_s": self.config.lease_s,
                "report_s": self.config.report_s,
            },
            {"known": known},
        )

    # ---- handing work out ----------------------------------------------------------------
    def _serve(self, request: _Parked, now: float) -> bool:
        """Answer one work request with a batch; False when there is nothing for it yet."""
        if request.session not in self.sessions:
            return True  # gone meanwhile
        held = self.state.session_batches(request.session)
        if held >= self.config.session_max_batches or self.stall.is_stalled(request.session):
            return False
        if self.state.peek_batch_id() >= self.batch_ids_end:
            if not self.disk.ready(now):  # a full disk: tried once a second, logged once
                return False
            try:
                self._reserve_batch_ids()
            except DiskFullError as exc:
                self.disk.failed(exc, now)
                return False
            self.disk.succeeded(now)
        batch = self.state.next_batch(
            request.session, request.model, request.max_items, request.max_tokens, now
        )
        if batch is None:
            return False
        self.stall.handed(request.session, now, was_idle=held == 0)
        self._send_batch(request.route[0], batch)
        return True

    def _reserve_batch_ids(self) -> None:
        first = self.batch_ids.next(floor=time.time_ns() // 1000, count=BATCH_ID_BLOCK)
        self.state.set_next_batch_id(first - 1)
        self.batch_ids_end = first + BATCH_ID_BLOCK

    def _serve_parked(self, now: float) -> None:
        for _ in range(len(self.parked)):
            request = self.parked.popleft()
            if self._serve(request, now):
                continue
            if now >= request.until:
                self._send(request.route[0], MT.NO_WORK, {"retry_ms": 0})
            else:
                self.parked.append(request)

    def _send_batch(self, route: bytes, batch: Batch) -> None:
        shape = self.shapes.get(batch.shape) or {}
        task = "embed" if shape.get("endpoint") == "/v1/embeddings" else "generate"
        meta = {
            "batch_id": batch.batch_id,
            "segment": batch.segment_id,
            "lane": batch.lane,
            "task": task,
            "model": batch.model,
            "shape": batch.shape,
            "max_tokens": int(shape.get("max_tokens") or 16),
            "sampling": {
                k: shape.get(k) for k in ("temperature", "top_p", "seed", "stop", "top_logprobs")
            },
            "lease_s": self.config.lease_s,
            "token": self.tokens.token(batch.batch_id, batch.session, batch.items),
        }
        self.file.lease(batch.batch_id, batch.session, batch.items)
        self._recorded.add(batch.batch_id)
        self._send(
            route,
            MT.WORK,
            meta,
            {"items": batch.items, "lengths": batch.lengths, "slots": batch.slots},
        )
        batch.slots = batch.tokens = batch.lengths = np.zeros(0, np.uint32)  # the worker has them
        session = self.sessions.get(batch.session)
        if session is not None:
            session.handed_out += len(batch.items)
        self.counts["handed_out"] += len(batch.items)
        self.dispatched[batch.model] += len(batch.items)

    def _hand_back(
        self, session: str, items: np.ndarray | None, reason: str, count_attempt: bool
    ) -> None:
        if items is None or not len(items):
            return
        back = 0
        for batch in self.state.leases(session):
            mine = items["segment"] == batch.segment_id
            if mine.any():
                back += self.state.reclaim(
                    batch.batch_id,
                    count_attempt=count_attempt,
                    slots=items["slot"][mine].astype(np.int64),
                )
        self.reclaimed["handed_back"] += back
        self.log.info("session %s handed back %d item(s): %s", session, back, reason)

    # ---- results and outcomes -------------------------------------------------------------
    def _results(self, message: wire.Message, session_id: str, now: float) -> None:
        """Forward a registered session's results if their work token verifies (gpu/work_token.py);
        else refuse them (RESULTS_REFUSED: the worker drops them) and count and log it."""
        meta = message.meta
        problem = self.tokens.results_problem(
            session_id,
            meta.get("batch_id"),
            meta.get("token"),
            item_array(message, "issued"),
            item_array(message, "items"),
        )
        if problem is not None:
            self.refused.add("results", session_id, problem)
            answer = {"result_ids": [meta["result_id"]], "reason": problem}
            self._send(message.route[0], MT.RESULTS_REFUSED, answer)
            return
        self._forward_results(message)
        self.state.answered(session_id, meta["batch_id"])
        if not meta.get("resent"):
            self.stall.answered(session_id, now)

    def _forward_results(self, message: wire.Message) -> None:
        if len(self.to_completion) >= MAX_WAITING_FOR_COMPLETION:
            self.log.warning("completion is not taking results; dropped one batch (resent later)")
            return  # the worker keeps it unacknowledged and sends it again
        meta = dict(message.meta)
        meta["route"] = message.route[0].hex()
        meta.pop("token", None)
        arrays = {name: a for name, a in message.arrays.items() if name != "issued"}
        self.to_completion.append((MT.RESULTS, meta, arrays))

    def _outcomes(self) -> None:
        outcome = self.state.take_outcomes()
        attempts = self.config.max_attempts
        for items, reason in (
            (
                outcome.dead_letters,
                f"{DEAD_LETTER}: the item was reclaimed {attempts} time(s) (its worker died, "
                "stopped answering or let the lease expire each time)",
            ),
            (outcome.quarantined, f"{CORRUPT_INPUT}: the stored item failed its checksum"),
            (outcome.cancelled, f"{CANCELLED}: the job was cancelled"),
        ):
            if len(items):
                self.to_completion.append((MT.ITEM_ERRORS, {"reason": reason}, {"items": items}))
                due = time.monotonic() + ITEM_ERRORS_RESEND_S
                self.unretired_errors.append([due, reason, items])
        for items, code in (
            (outcome.dead_letters, DEAD_LETTER),
            (outcome.quarantined, CORRUPT_INPUT),
        ):
            if len(items):
                self._note_dead_letters(items, code)

    def _note_dead_letters(self, items: np.ndarray, code: str) -> None:
        """Count dead-lettered or corrupt items and keep one event per job for BROKER_STATUS."""
        self.counts[code] += len(items)
        jobs = items["seq"] >> np.uint64(32)
        for job_no in np.unique(jobs).tolist():
            mine = items[jobs == job_no]
            self.dead_letters.append(
                {
                    "ns": time.time_ns(),
                    "reason": code,
                    "job_no": int(job_no),
                    "items": len(mine),
                    "segments": np.unique(mine["segment"]).tolist(),
                }
            )

    def _flush_to_completion(self) -> None:
        while self.to_completion:
            kind, meta, arrays = self.to_completion[0]
            try:
                wire.send(self.completion, kind, meta, arrays)
            except FabricError:
                return  # completion restarting or busy: keep them, try on the next step
            self.to_completion.popleft()

    def _resend_item_errors(self, now: float) -> None:
        """Item errors completion has not retired within ITEM_ERRORS_RESEND_S go again."""
        self.unretired_errors = [e for e in self.unretired_errors if len(e[2])]
        for entry in self.unretired_errors:
            due, reason, items = entry
            if now >= due:
                self.log.warning(
                    "%d item error(s) not retired %g s after sending; sent again",
                    len(items),
                    ITEM_ERRORS_RESEND_S,
                )
                self.to_completion.append((MT.ITEM_ERRORS, {"reason": reason}, {"items": items}))
                entry[0] = now + ITEM_ERRORS_RESEND_S

    # ---- time ----------------------------------------------------------------------------
    def _timeouts(self, now: float) -> None:
        limit = self.config.session_timeout_s
        for session_id, session in list(self.sessions.items()):
            if now - session.last_seen > limit:
                lost = self.state.drop_session(session_id)
                self.reclaimed["session_lost"] += lost
                del self.sessions[session_id]
                self.stall.forget(session_id)
                self.log.warning(
                    "session %s silent for %.1f s (limit %.1f s): gone; %d item(s) reclaimed",
                    session_id,
                    now - session.last_seen,
                    limit,
                    lost,
                )
        expired = self.state.expire(now)
        self.reclaimed["lease_expired"] += expired
        if expired:
            self.log.warning("%d item(s) reclaimed after their lease expired", expired)

    def _reclaim_stalled(self, now: float) -> None:
        """Sessions that report (renewing their leases) but send no results past their stall
        limit (gpu/dispatch_stall.py): their unanswered batches go back to the queue."""
        holding = {s: self.state.session_batches(s) for s in self.sessions}
        for stall in self.stall.find(holding, now):
            back = self.state.reclaim_unanswered(stall.session)
            self.reclaimed["stalled"] += back
            self.log.warning(
                "session %s holds batches with no results for %.1f s (stall limit %.1f s): "
                "stalled; %d item(s) reclaimed, no new work until its results come",
                stall.session,
                stall.silent_s,
                stall.limit_s,
                back,
            )

    def _record_ended(self) -> None:
        for batch_id, slots in self.state.take_dropped():
            if batch_id in self._recorded:
                self.file.drop(batch_id, slots)
        for batch_id in self.state.take_ended():
            if batch_id in self._recorded:
                self._recorded.discard(batch_id)
                self.file.drop(batch_id)

    def _live_leases(self):
        from gpu.dispatch_files import Lease

        return [Lease(b.batch_id, b.session, b.items) for b in self.state.leases()]

    # ---- what it reports (gpu/dispatch_report.py) ------------------------------------------
    def stats(self, now: float) -> dict:
        """Queues, queue age, workers, dispatches, reclaims and dead letters (docs/metrics.md)."""
        return dispatch_metrics(self, now)

    def _send(self, route: bytes, kind: MT, meta: dict, arrays: dict | None = None) -> None:
        try:
            wire.send(self.workers, kind, meta, arrays, route=(route,))
        except FabricError as exc:  # a gone or stuck worker never blocks dispatch
            self.log.debug("could not send %s to %r: %s", kind.name, route, exc)

    # ---- stopping ------------------------------------------------------------------------
    def drain(self, deadline: float) -> None:
        while self.to_completion and time.monotonic() < deadline:
            self._flush_to_completion()
            self.poller.poll(10)

    def close(self) -> None:
        self.file.close()
        for segment in self.state.segments():
            segment.close()
        self.workers.close(0)
        self.inbox.close(0)
        self.completion.close()
        self.gate.close()
        self.context.term()
