"""The completion stage: results in, durable, inputs retired, workers acknowledged; results out.

Sockets:

| socket            | kind   | peer                                                                 |
|-------------------|--------|----------------------------------------------------------------------|
| `completion` ipc  | PULL   | dispatch: RESULTS (as workers sent them), ITEM_ERRORS (dead letters, quarantined, cancelled) |
| `dispatch` ipc    | PUSH   | dispatch: RETIRED (input slots now DEAD on disk, the worker acks, refused results to hand back), CANCEL_JOB and JOB_CONTROL |
| `completion.bind` | ROUTER | results clients: FETCH / RESULT_PAGE, JOB_STATUS / JOB_INFO, CANCEL / CANCELLED, CONTROL / JOB_INFO |

Each step takes what arrived and stores it (collector/completion/intake.py:
every worker result checked against its item, a bad one handed back to
dispatch with the next RETIRED or stored as the item's error
`invalid_result`; CompletionLog.record, no sync yet), then makes it durable in
one group commit and only then writes the input tombstones (`sync_outputs`);
jobs it made done finish there (collector/completion/finishing.py). About every
`tombstone_flush_ms` the tombstones are synced and dispatch is told which
slots retired, with the acknowledgements for the workers whose results
those were: output, tombstone, count, retire, acknowledge (invariant 3).

Client requests: FETCH (collector/completion/delivery.py: pages, marked
delivered once acknowledged), JOB_STATUS (collector/completion/job_status.py,
which only reads), CANCEL (collector/completion/cancel.py).

The stage's logic takes its time from `step(now)` (monotonic seconds; only
the run loop and `drain` read the clock) and the finished mark's wall-clock
time from `wall_ns`, so tests drive a real stage on a fake clock.

A full disk (DiskFullError) stops nothing: results that cannot be stored
are not acknowledged (their workers keep them and send them again), item
errors from dispatch (sent once) are kept here, client requests are served
as before, one ERROR line says so, and a store (of the latest results
refused) is tried again every second until one goes through
(pipeline/store/disk_full.py).
"""

from __future__ import annotations

import collections
import math
import time

import numpy as np
import zmq

from collector.completion import cancel, control
from collector.completion.caps import CapWatch
from collector.completion.delivery import PageDelivery
from collector.completion.figures import completion_figures
from collector.completion.finishing import JobFinisher
from collector.completion.input_segments import InputSegments
from collector.completion.intake import ResultIntake
from collector.completion.job_status import JobStatus
from collector.completion.job_webhooks import JobWebhooks
from collector.completion.results_log import CompletionLog
from collector.completion.reuse import ResultReuse
from collector.job_view import JobIndex, JobView
from config.stage_settings import CompletionStageSettings
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core.errors import DiskFullError, FabricError
from pipeline.process.stage import Stage
from pipeline.store.datadir import DataDir
from pipeline.store.disk_full import FullDisk
from pipeline.store.intern_table import InternTable
from pipeline.store.job_files import JOB_ID
from pipeline.transport import wire
from pipeline.transport.security import ServerGate
from pipeline.transport.topology import internal_address
from pipeline.transport.wire import forwarded

MT = wire.MessageType
MAX_MESSAGES_PER_STEP = 256
TIDY_S = 1.0


class CompletionStage(Stage[CompletionStageSettings]):
    name = "completion"
    poller: zmq.Poller  # made by open()
    poll_ms = 10

    def open(self) -> None:
        settings = self.settings
        self.config = settings.completion
        self.data_dir = DataDir(settings.data_path).ensure()
        self.jobs = JobIndex(settings.data_path)
        self.shapes = InternTable(settings.data_path)
        self.inputs = InputSegments(self.data_dir)
        self.completion_log = CompletionLog(
            self.data_dir, self.inputs.get, expected_items=self._lines_known, line_table=self._lines
        )
        self.wall_ns = time.time_ns  # the finished mark's timestamp (tests give a fake clock)
        self.intake = ResultIntake(
            self.completion_log,
            self.jobs,
            self.shapes,
            self.inputs.get,
            settings.max_attempts,
            self.log,
        )
        self.intake.reuse = self.reuse = ResultReuse(  # `submit --reuse` (reuse.py)
            settings.data_path,
            self.completion_log,
            self.config.reuse_retention_s,
            self.config.reuse_max_bytes,
            self.log,
        )
        self.status = JobStatus(self.completion_log, self.intake.worker_time)
        self.delivery = PageDelivery(self.completion_log, self.shapes, self.config.page_items)
        self.webhooks = JobWebhooks(settings.data_path, settings.api, self.log)  # --notify
        self.finishing = JobFinisher(
            self.completion_log, self.jobs, lambda: self.wall_ns(), self.log, self.webhooks.ended
        )
        self.flush_s = self.config.tombstone_flush_ms / 1000
        self.next_flush: float | None = None  # set from the first step's clock
        self.next_tidy = 0.0  # the first step tidies: it takes up every unfinished job
        self.disk = FullDisk(
            self.log,
            "results are not taken (workers keep them unacknowledged and send them again); "
            "status and results reads go on",
        )
        self.deferred: collections.deque[wire.Message] = collections.deque()  # ITEM_ERRORS
        self.probe: wire.Message | None = None  # the latest RESULTS refused: tried each second
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        inbox = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(settings, "completion")
        )
        # forwarded RESULTS come as the worker sent them (pipeline/transport/wire/forwarded.py)
        self.inbox = wire.Inbox(inbox, self.log, "dispatch", receive=forwarded.recv)
        self.dispatch = wire.open_socket(
            self.context,
            zmq.PUSH,
            linger_ms=2000,
            send_timeout_ms=1000,
            connect=internal_address(settings, "dispatch"),
        )
        self.caps = CapWatch(self.completion_log, self.intake.worker_time, self.dispatch, self.log)
        self.clients = wire.open_socket(self.context, zmq.ROUTER)
        self.clients.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)  # bigger: dropped
        self.limits = wire.WireLimits(max_bytes=self.config.max_message_bytes)
        self.gate.secure(self.clients)
        self.clients.bind(self.config.bind)
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(self.clients, zmq.POLLIN)

    def _lines_known(self, job_id: str) -> int:
        """Lines of the job committed so far, as last read (sizes its completion segments)."""
        view = self.jobs.views.get(job_id)
        return 0 if view is None else view.stored + view.rejected_count

    # ---- the loop --------------------------------------------------------------------------
    def _lines(self, job_id: str):
        """The job's fan-out line table (pipeline/core/line_table.py), None if no job."""
        view = self.jobs.view(job_id)
        return None if view is None else view.lines

    def step(self, now: float) -> None:
        if self.next_flush is None:
            self.next_flush = now + self.flush_s
        if not self.webhooks.alive():
            raise RuntimeError("the webhook sender thread stopped")
        events = dict(self.poller.poll(self._wait_ms(now)))
        if self.inbox.socket in events or self.deferred or self.probe is not None:
            self._read_inbox(now)
        self._sync_outputs(now)  # outputs durable, then their tombstones written
        if now >= self.next_flush:
            self._flush(now)
            self.next_flush = now + self.flush_s
        if self.clients in events:
            self._read_clients(now)
        if now >= self.next_tidy:
            self.next_tidy = now + TIDY_S
            self._tidy(now)
            self.disk.settle(now)
        self.reuse.flush(now)  # results of reusing jobs indexed; eviction

    def _wait_ms(self, now: float) -> int:
        """How long the next step may wait for a message: `poll_ms` while results wait for the
        disk (a full disk: deferred, a probe, unsynced outputs), else until the next flush or
        tidy (the flush only while it has tombstones, acks or hand-backs to send). Messages
        wake it at once, so an idle stage wakes once a second, not 100 times."""
        log = self.completion_log
        if self.deferred or self.probe is not None or log.unsynced:
            return self.poll_ms
        due = self.next_tidy
        if log.tombstones_pending or self.intake.acks or self.intake.hand_back:
            due = min(self.next_flush, due)
        return max(0, int((due - now) * 1000))

    def _sync_outputs(self, now: float) -> None:
        """The group commit; then the jobs given results finish if they are done."""
        log = self.completion_log
        if log.unsynced and self.disk.ready(now):
            try:
                log.sync_outputs()
            except DiskFullError as exc:  # everything stays queued for the next try
                self.disk.failed(exc, now)
        self.intake.worker_time.write(now)  # each job's worker-seconds, every second
        if self.intake.touched and not log.unsynced:  # their results are durable
            touched, self.intake.touched = self.intake.touched, set()
            for job_id in touched:
                view = self.jobs.view(job_id)
                if view is not None:
                    try:
                        self.caps.check(view)  # a job past one of its limits is stopped
                    except DiskFullError as exc:  # checked again with its next results
                        self.disk.failed(exc, now)
                    self._finish_if_done(view, now)

    def _flush(self, now: float) -> None:
        """Sync the tombstones; tell dispatch what retired, with the acks and hand-backs."""
        if self.completion_log.unsynced:  # outputs not durable yet (a full disk): ack nothing
            return
        try:
            retired = self.completion_log.flush_tombstones()
        except DiskFullError as exc:  # the tombstones and acks wait for the next flush
            self.disk.failed(exc, now)
            return
        intake = self.intake
        if not retired and not intake.acks and not intake.hand_back:
            return
        parts = []
        for segment_id, slots in retired.items():
            items = np.zeros(len(slots), ITEM_DTYPE)
            items["segment"] = segment_id
            items["slot"] = slots
            parts.append(items)
        items = np.concatenate(parts) if parts else np.zeros(0, ITEM_DTYPE)
        back = [items for _, _, items in intake.hand_back]
        meta = {"acks": intake.acks, "refused": [[s, b, len(i)] for s, b, i in intake.hand_back]}
        arrays = {"items": items, "refused": np.concatenate(back) if back else items[:0]}
        try:
            wire.send(self.dispatch, MT.RETIRED, meta, arrays)
        except FabricError as exc:  # dispatch restarting: it rereads markers; workers resend
            self.log.warning("could not tell dispatch of %d retired item(s): %s", len(items), exc)
        intake.acks = []
        intake.hand_back = []

    def _read_inbox(self, now: float) -> None:
        while self.deferred and self._store(self.deferred[0], now):
            self.deferred.popleft()
        if self.probe is not None and self._store(self.probe, now):
            self.probe = None  # the disk takes results again, without waiting for a resend
        for message in self.inbox.read(MAX_MESSAGES_PER_STEP):
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
                self.intake.results(message)
            else:
                self.intake.item_errors(message)
        except DiskFullError as exc:
            self.disk.failed(exc, now)
            return False
        except (KeyError, ValueError, TypeError) as exc:
            self.log.error("bad %s message dropped: %s", message.type.name, exc)
            return True
        self.disk.succeeded(now)
        return True

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
        if message.type not in (MT.FETCH, MT.JOB_STATUS, MT.CANCEL, MT.CONTROL):
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
            why = meta.get("reason")  # None, or cancel.AT_DEADLINE
            reason = cancel.refusal(view, self._job_info(view, now)["state"], why)
            if reason:
                self._reply(route, MT.ERROR, {"reason": reason})
                return
            cancel.cancel_job(view, self.dispatch, self.log, why)
            self._reply(route, MT.CANCELLED, self._job_info(view, now))
        elif message.type == MT.CONTROL:
            reason = control.refusal(view, self._job_info(view, now)["state"], meta)
            if reason:
                self._reply(route, MT.ERROR, {"reason": reason})
                return
            control.control_job(view, meta, self.dispatch, self.log)
            self._reply(route, MT.JOB_INFO, self._job_info(view, now))
        else:
            self._fetch(route, view, meta, now)

    def _fetch(self, route, view: JobView, meta: dict, now: float) -> None:
        reason = self.delivery.refusal(view, meta)
        if reason:
            self._reply(route, MT.ERROR, {"reason": reason})
            return
        try:
            self.delivery.acknowledge(view.job_id, meta)
        except DiskFullError as exc:  # marked in memory; made durable by a later sync
            self.disk.failed(exc, now)
        reply, arrays = self.delivery.page(view, meta, lambda: self._job_info(view, now))
        self._reply(route, MT.RESULT_PAGE, reply, arrays)

    def _job_info(self, view: JobView, now: float) -> dict:
        info = self.status.info(view, self.finishing.finished(view.job_id), now)
        info["webhook"] = self.webhooks.delivery(view.job_id)  # its end's event, if any
        return info

    def _catch_up(self, view: JobView, now: float) -> None:
        """Read what the front appended; rejected lines become error results.

        Not once the job has finished: its results may be collected by then, and
        the rejected lines were stored before it could finish. On a full disk the
        rejected lines stay in the view for a later try.
        """
        view.refresh()
        if not view.rejected and not view.found:
            return
        if self.finishing.finished(view.job_id):
            view.take_rejected()
            view.found = []
            return
        if not self.disk.ready(now):
            return
        try:
            self.intake.rejected_lines(view)
            self.reuse.store_found(view)  # lines the reuse index answered (reuse.py)
            if view.reuse and self.finishing.done(view):  # done now: its results indexed
                self.reuse.flush(now, force=True)
        except DiskFullError as exc:
            self.disk.failed(exc, now)

    def stats(self, now: float) -> dict:
        more = {**self.disk.figures(self.label), **self.webhooks.stats()}
        return completion_figures(self.intake, self.delivery.delivered, self.caps.stopped, more)

    def _reply(
        self, route, kind: MT, meta: dict, arrays: dict | None = None, flags: int = 0
    ) -> None:
        try:
            wire.send(self.clients, kind, meta, arrays, route=route, flags=flags)
        except FabricError as exc:
            self.log.debug("could not answer a client: %s", exc)

    # ---- housekeeping --------------------------------------------------------------------
    def _tidy(self, now: float) -> None:
        """Release finished input segments; take up jobs not finished and not loaded yet (at
        the first step: those that finished before a restart); finish jobs whose every item
        has a result; unload finished jobs once nothing of theirs is undelivered."""
        self.inputs.release_finished()
        self.finishing.discover()
        log = self.completion_log
        for job_id in log.known_jobs():
            view = self.jobs.view(job_id)
            if view is None:
                continue
            if self.finishing.finished(job_id):
                if not self.delivery.outstanding(job_id) and not log.undelivered(job_id):
                    log.unload(job_id)  # all delivered: free its bitmaps and handles
                    self.intake.worker_time.forget(job_id)
                    self.jobs.forget(job_id)
                continue
            self._catch_up(view, now)
            if not log.unsynced:  # its results are durable
                self._finish_if_done(view, now)

    def _finish_if_done(self, view: JobView, now: float) -> None:
        if view.reuse and self.finishing.done(view):  # its results indexed before it finishes
            self.reuse.flush(now, force=True)
        try:
            self.finishing.finish_if_done(view)
        except DiskFullError as exc:  # finished at a later tidy
            self.disk.failed(exc, now)

    def drain(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            events = dict(self.poller.poll(20))
            if self.inbox.socket not in events:
                break
            now = time.monotonic()
            self._read_inbox(now)
            self._sync_outputs(now)
        now = time.monotonic()
        self.disk.next_try = now  # one last try each
        self._sync_outputs(now)
        self._flush(now)
        if self.completion_log.unsynced or self.deferred:
            self.log.error(
                "stopping on a full disk: results not stored are sent again by their workers; "
                "%d item error batch(es) not stored (their items stay queued; dispatch meets "
                "them again after a restart)",
                len(self.deferred),
            )

    def close(self) -> None:
        if getattr(self, "webhooks", None) is not None:
            self.webhooks.close()
        self.intake.worker_time.write(math.inf)  # each job's worker-seconds as they stand
        if getattr(self, "reuse", None) is not None:
            try:
                self.reuse.close()  # what was appended is indexed
            except OSError as exc:
                self.log.error("closing the reuse index: %s", exc)
        try:
            self.completion_log.close()
        except DiskFullError as exc:  # seals not durable: recovery finds them open, harmless
            self.log.error("closing the completion log: %s", exc)
        self.inputs.close()
        self.inbox.socket.close(0)
        self.dispatch.close()
        self.clients.close(0)
        self.gate.close()
        self.context.term()
