"""The dispatch stage: one owner of all dispatch state, between the segment log and GPU workers.

Sockets (docs/dispatch.md has the message table):

| socket           | kind   | peer                                                        |
|------------------|--------|-------------------------------------------------------------|
| `dispatch.bind`  | ROUTER | workers (WORKER_HELLO, WORK_REQUEST, REPORT, RESULTS, HAND_BACK, BYE) and `status` clients (BROKER_STATUS) |
| `dispatch` ipc   | PULL   | writers (APPENDED) and the completion stage (RETIRED, CANCEL_JOB) |
| `completion` ipc | PUSH   | the completion stage: RESULTS forwarded as they came (gpu/dispatch/forward.py), ITEM_ERRORS |

The owner thread runs `step()`: it reads what arrived (the inbox's messages
in gpu/dispatch/inbox.py), answers workers, expires leases and silent
sessions (gpu/dispatch/timeouts.py; only after loading: invariant 9), sends
dead letters, quarantined and cancelled items to the completion stage as
error results, and hands the dispatch file its entries. ZeroMQ's own I/O
thread moves the bytes; the dispatch file is written and synced on its own
thread (gpu/dispatch/file.py).

Work is learnt three ways: the segment files found at start (every LIVE
slot, invariant 4), the writers' APPENDED descriptors (after their fsync),
and a rescan of the segment directory every second (a descriptor lost
while this stage restarted is found there). Segments queued before this
start are held back for `reregister_grace_s`, so that workers that still
hold some of their items re-register first (invariant 8); a restarted
stage also reloads its dispatch file (same epoch, invariant 11). Job
deadlines come from the job records (gpu/dispatch/deadlines.py), read again
on the rescan.

Each batch goes out with a work token (gpu/dispatch/work_token.py); RESULTS and the
claims of a WORKER_HELLO are taken only from a registered session, for
items a token of this data dir covers.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import zmq

from config.stage_settings import DispatchStageSettings
from gpu.dispatch.arrivals import Arrivals
from gpu.dispatch.batch import Batch, item_array
from gpu.dispatch.batch_ids import BatchIds
from gpu.dispatch.deadlines import JobDeadlines
from gpu.dispatch.demand_view import Demand
from gpu.dispatch.forward import ToCompletion
from gpu.dispatch.inbox import cancelled_jobs, read_inbox
from gpu.dispatch.item_errors import ItemErrors
from gpu.dispatch.lease_recorder import LeaseRecorder
from gpu.dispatch.paused import paused_marks
from gpu.dispatch.registration import hello, reload_leases
from gpu.dispatch.report import broker_status, dispatch_metrics
from gpu.dispatch.sessions import PARK_S, Parked, Session, worker_figures
from gpu.dispatch.stall import StallWatch
from gpu.dispatch.state import DispatchState
from gpu.dispatch.timeouts import expire_sessions_and_leases, reclaim_stalled
from gpu.dispatch.work_finder import RESCAN_S, WorkFinder
from gpu.dispatch.work_token import Refusals, WorkTokens
from pipeline.core.errors import FabricError
from pipeline.process.stage import Stage
from pipeline.store.datadir import DataDir
from pipeline.store.intern_table import InternTable
from pipeline.transport import wire
from pipeline.transport.security import ServerGate
from pipeline.transport.topology import internal_address

MT = wire.MessageType
MAX_MESSAGES_PER_STEP = 512  # from workers, and from the inbox, in one step


class DispatchStage(Stage[DispatchStageSettings]):
    name = "dispatch"
    poller: zmq.Poller  # made by open()
    reclaimed: collections.Counter[str]
    poll_ms = 20  # while lease records wait for their group commit (dispatch.sync_ms)
    idle_poll_ms = 100  # otherwise: workers and the inbox wake it; this is for the timers

    def open(self) -> None:
        settings = self.settings
        config = settings.dispatch
        self.config = config
        self.data_dir = DataDir(settings.data_path).ensure()
        now = time.monotonic()  # the stage's start; after it, time comes from step(now)
        self.wall_offset_s = time.time() - now  # `wall(now)`: the wall clock on step's clock
        self.deadlines = JobDeadlines(self.data_dir.root, self.log)  # from job records
        self.deadlines.refresh(now)
        self.state = DispatchState(config.lease_s, config.max_attempts, self.deadlines)
        self.tokens = WorkTokens.of_data_dir(self.data_dir.root)  # gpu/dispatch/work_token.py
        self.refused = Refusals(self.log)  # results, claims: refused for want of a token
        self.stall = StallWatch(config.stall_batch_multiple, config.stall_min_s)  # no progress
        self.batch_ids = BatchIds(self.data_dir.root, self.state, self.log)  # never reused
        self.disk = self.batch_ids.disk
        self.shapes = InternTable(settings.data_path)
        self.sessions: dict[str, Session] = {}
        self.parked: collections.deque[Parked] = collections.deque()
        self.counts = collections.Counter[str]()
        # sessions whose hello came back holding live work (a worker whose WELCOME is late says
        # hello again: a set, so the status answer counts each worker once)
        self.came_back_holding: set[str] = set()
        self.item_errors = ItemErrors(  # sent to completion until retired (item_errors.py)
            config.max_attempts,
            lambda *error: self.to_completion.item_errors(*error),
            self.counts,
            self.log,
        )
        self.dead_letters = self.item_errors.dead_letters  # recent events, for BROKER_STATUS
        self.dispatched = collections.Counter[str]()  # model -> items handed out (metrics)
        self.reclaimed = collections.Counter()  # cause -> items put back in the queue (metrics)
        self.arrivals = Arrivals()  # when queued slots became durable: the queue's age
        self.samples: collections.deque = collections.deque(maxlen=11)  # (t, out, retired)
        self.demand = Demand(config.demand_horizon_s)  # gpu/dispatch/demand_view.py
        grace_until = now + config.reregister_grace_s
        self.finder = WorkFinder(
            self.data_dir, self.state, self.arrivals, self.shapes, self.counts, self.log
        )
        self.damaged = self.finder.damaged  # file name -> what is wrong (status, metrics)
        self.finder.rescan(now, not_before=grace_until)
        self.next_rescan = now + RESCAN_S
        (self.data_dir.root / "dispatch").mkdir(exist_ok=True)
        self.leases = LeaseRecorder(
            self.data_dir.root / "dispatch" / "inflight.log",
            self.epoch,
            self.state,
            self.config.compact_min_bytes,
        )
        self.file = self.leases.file
        reload_leases(self, now)  # gpu/dispatch/registration.py
        self.state.cancelled_jobs.update(cancelled_jobs(self.data_dir.root, self.log))
        self.state.paused.jobs.update(paused_marks(self.data_dir.root, self.log))
        self.state.loaded()  # lease and session timeouts count from here (invariant 9)
        self.demand.refresh(self, now)  # then once per rescan
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        self.workers = wire.open_socket(self.context, zmq.ROUTER)
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting session takes its id back
        self.workers.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)  # bigger: disconnected
        self.limits = wire.WireLimits(max_bytes=config.max_message_bytes)
        self.gate.secure(self.workers)
        self.workers.bind(settings.dispatch.bind)
        inbox = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(settings, "dispatch")
        )
        self.inbox = wire.Inbox(inbox, self.log, "a writer or completion")
        self.completion = wire.open_socket(
            self.context,
            zmq.PUSH,
            linger_ms=2000,
            send_hwm=10_000,
            connect=internal_address(settings, "completion"),
        )
        self.to_completion = ToCompletion(self.completion, self.log)  # gpu/dispatch/forward.py
        self.poller = zmq.Poller()
        self.poller.register(self.workers, zmq.POLLIN)
        self.poller.register(inbox, zmq.POLLIN)
        self.log.info(
            "dispatch up: %d segment(s) with work, epoch %d, grace %.1f s",
            len(self.state.queued_segments()),
            self.epoch,
            config.reregister_grace_s,
        )

    # ---- the loop --------------------------------------------------------------------------
    def step(self, now: float) -> None:
        if self.to_completion.waiting:
            timeout = 0
        elif self.file.pending_entries or self.file.failing:
            timeout = self.poll_ms
        else:
            timeout = self.idle_poll_ms
        release = self.state.next_release(now) if self.parked else None
        if release is not None:  # a parked request may be served once the grace is over
            timeout = min(timeout, max(0, int((release - now) * 1000)))
        events = dict(self.poller.poll(timeout))
        if self.inbox.socket in events:
            read_inbox(self, now, MAX_MESSAGES_PER_STEP)  # gpu/dispatch/inbox.py
            self.state.sweep_cancelled()  # work that just arrived for a cancelled job
        if self.workers in events:
            self._read_workers(now)
        self._serve_parked(now)
        expire_sessions_and_leases(self, now)  # gpu/dispatch/timeouts.py
        self.item_errors.take(self.state.take_outcomes(), now)
        self.to_completion.flush()
        self.leases.record_ended()
        self.file.maybe_sync(now)
        if now >= self.next_rescan:
            self.next_rescan = now + RESCAN_S
            self.samples.append((now, self.counts["handed_out"], self.counts["retired"]))
            for session in self.sessions.values():
                session.idle_marks.append((now, session.idle_s))
            self.finder.rescan(now)
            self.deadlines.refresh(now)  # new jobs' deadlines; finished jobs forgotten
            self.demand.refresh(self, now)  # workers needed, deadline projections, slack
            self.item_errors.resend(now)
            reclaim_stalled(self, now)
            self.state.sweep_cancelled()
            for q in self.state.queue_depth():
                self.arrivals.forget_below(q.segment_id, q.floor)  # marks no slot can need again
            for segment in self.state.forget_finished():
                self.arrivals.forget(segment.segment_id)
                self.log.info("segment %d finished; released", segment.segment_id)
                segment.close()
            self.leases.maybe_compact()

    def _read_workers(self, now: float) -> None:
        refuse = lambda route, reason: self.send(route[0], MT.ERROR, {"reason": reason})  # noqa: E731
        for message in wire.requests(
            self.workers, MAX_MESSAGES_PER_STEP, self.limits, self.log, "worker", refuse
        ):
            try:
                self._handle(message, now)
            except (KeyError, ValueError, TypeError) as exc:
                self.log.warning("bad %s message refused: %s", message.type.name, exc)
                self.send(message.route[0], MT.ERROR, {"reason": f"bad message: {exc}"})

    def _handle(self, message: wire.Message, now: float) -> None:
        meta, route = message.meta, message.route[0]
        kind = message.type
        if kind == MT.BROKER_STATUS:
            self.send(route, MT.BROKER_INFO, broker_status(self, now))
            return
        if kind == MT.PING:
            self.send(route, MT.PONG, {"epoch": self.epoch})
            return
        session_id = meta.get("session")
        if not isinstance(session_id, str) or route != session_id.encode():
            self.send(route, MT.ERROR, {"reason": "a worker's socket identity must be its session"})
            return
        if kind == MT.WORKER_HELLO:
            hello(self, message, session_id, now)
            return
        session = self.sessions.get(session_id)
        if kind == MT.RESULTS and session is None:  # it re-registers, then sends them again
            self.refused.add("results", session_id, "the session is not registered", now)
        if session is None:
            self.send(route, MT.UNKNOWN_SESSION, {"session": session_id})
            return
        session.last_seen = now
        if kind == MT.RESULTS:
            self._results(message, session_id, now)
            return
        if kind == MT.WORK_REQUEST:
            request = Parked(
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
            self.send(route, MT.ERROR, {"reason": f"dispatch does not take {kind.name}"})

    # ---- handing work out ----------------------------------------------------------------
    def _serve(self, request: Parked, now: float) -> bool:
        """Answer one work request with a batch; False when there is nothing for it yet."""
        if request.session not in self.sessions:
            return True  # gone meanwhile
        held = self.state.session_batches(request.session)
        if held >= self.config.session_max_batches or self.stall.is_stalled(request.session):
            return False
        if not self.batch_ids.ready(now):  # a full disk
            return False
        batch = self.state.next_batch(
            request.session, request.model, request.max_items, request.max_tokens, now
        )
        if batch is None:
            return False
        self.stall.handed(request.session, now, was_idle=held == 0)
        self._send_batch(request.route[0], batch)
        return True

    def _serve_parked(self, now: float) -> None:
        for _ in range(len(self.parked)):
            request = self.parked.popleft()
            if self._serve(request, now):
                continue
            if now >= request.until:
                self.send(request.route[0], MT.NO_WORK, {"retry_ms": 0})
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
        self.leases.record(batch)
        self.send(
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
        """Forward a registered session's results if their work token verifies (gpu/dispatch/work_token.py);
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
            self.refused.add("results", session_id, problem, now)
            answer = {"result_ids": [meta["result_id"]], "reason": problem}
            self.send(message.route[0], MT.RESULTS_REFUSED, answer)
            return
        self.to_completion.results(message)  # docs/dispatch.md: results pass through unparsed
        batch = self.state.lease(meta["batch_id"])
        if batch is not None and not meta.get("resent"):  # the worker's measured rate
            items = item_array(message, "items")
            n = 0 if items is None else len(items)
            self.demand.rates.results(session_id, batch.model, n, batch.lane, batch.handed_s, now)
        self.state.answered(session_id, meta["batch_id"])
        if not meta.get("resent"):
            self.stall.answered(session_id, now)

    # ---- what it reports (gpu/dispatch/report.py) ------------------------------------------
    def stats(self, now: float) -> dict:
        """Queues, queue age, workers, dispatches, reclaims and dead letters (docs/metrics.md)."""
        return dispatch_metrics(self, now)

    def wall(self, now: float) -> float:
        """Wall seconds since the epoch at `now` (step's clock, a fake one in tests)."""
        return now + self.wall_offset_s

    def send(self, route: bytes, kind: MT, meta: dict, arrays: dict | None = None) -> None:
        try:
            wire.send(self.workers, kind, meta, arrays, route=(route,))
        except FabricError as exc:  # a gone or stuck worker never blocks dispatch
            self.log.debug("could not send %s to %r: %s", kind.name, route, exc)

    # ---- stopping ------------------------------------------------------------------------
    def drain(self, deadline: float) -> None:
        while self.to_completion.waiting and time.monotonic() < deadline:
            self.to_completion.flush()
            self.poller.poll(10)

    def close(self) -> None:
        self.file.close()
        for segment in self.state.segments():
            segment.close()
        self.workers.close(0)
        self.inbox.socket.close(0)
        self.completion.close()
        self.gate.close()
        self.context.term()
