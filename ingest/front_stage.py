"""The ingest front: where producers hand over chunks, and hear when they are durable.

One process, one owner of the job registry. Producers talk to it over a
ROUTER socket (`ingest.bind`):

| request      | answer     | meaning                                                    |
|--------------|------------|------------------------------------------------------------|
| HELLO        | CATALOG    | served models, lanes, chunk size, message size limit       |
| JOB_STATUS   | JOB_INFO   | a job's state, counts, chunk size and committed chunks     |
| SUBMIT_CHUNK | CHUNK_ACK  | every accepted item of the chunk is durable; its bad lines as arrays (ingest/error_wire.py) |
|              | CHUNK_ERROR| refused (not retryable) or failed (RETRYABLE: send it again) |

A chunk's life: the front checks it again (models, endpoints, lengths,
custom_ids repeated anywhere in the job), writes `accept` to the job's
journal and syncs it, then sends its items on: straight into the ring to a
router when they are tokens, or to a tokenizer when some are text. Writers
report what they made durable (APPEND_ACK); when every forwarded item is
accounted for, the front writes `commit` (with the custom_ids and the bad
lines), syncs it, and only then answers CHUNK_ACK. The journal syncs of one
step are one group commit.

What producers can make the front hold is capped (docs/wire.md, "Limits on
each port"): chunks in flight by count and by bytes, per producer connection
and in all (ingest/inflight.py: a chunk past a cap is refused, retryably), and
connections per address and in all (ingest/peer_guard.py: libzmq buffers a
frame whole before the front sees it, so only the number of connections
bounds that). Accepted chunks go on through ingest/chunk_forwarding.py; the
answers wait for the step's journal sync in ingest/producer_replies.py, and
those besides refusals are built in ingest/front_answers.py.

A chunk that does not complete by its deadline (a stage died and its rings
were replaced, a disk stalled) is answered with a retryable error; writers
drop records past that deadline. A retried chunk that was accepted before is
reconciled: items already in the log are counted, not stored again; after the
front alone restarted, only once the earlier try can no longer land
(ingest/parked_chunks.py).

The front reads no clock: `step(now)` is given the monotonic time (seconds),
and every deadline, the writers' CLOCK_MONOTONIC `deadline_ns` included, is
derived from it, so a test can drive the stage with a clock of its own.
"""

from __future__ import annotations

import time

import zmq

from config.stage_settings import FrontStageSettings
from ingest import front_answers
from ingest.catalog import ModelCatalog
from ingest.chunk_check import Checked, chunk_digests, recheck
from ingest.chunk_forwarding import ChunkForwarding
from ingest.chunk_wire import chunk_from_wire
from ingest.custom_ids import Digests
from ingest.error_wire import errors_from_wire
from ingest.inflight import DEADLINE_MARGIN_S, Inflight, InflightChunks
from ingest.input_chunk import InputChunk
from ingest.jobs import (
    Job,
    JobRegistry,
    parse_deadline_field,
    parse_limits_field,
    parse_priority_field,
)
from ingest.line_errors import LineError
from ingest.parked_chunks import ParkedChunks
from ingest.peer_guard import PeerGuard
from ingest.producer_replies import ProducerReplies
from ingest.reconcile import stored_by_earlier_try
from ingest.reuse_keys import ReuseFinder
from pipeline.core.errors import DiskFullError, FabricError, IngestError, WireError
from pipeline.core.job_states import JobState
from pipeline.process.stage import Stage
from pipeline.store.datadir import DataDir
from pipeline.store.disk_full import FullDisk
from pipeline.store.job_files import ChunkEntry, Landing, check_job_id
from pipeline.store.job_record import DELIVER_FILE, parse_deliver
from pipeline.transport import wire
from pipeline.transport.outlet import Outlet
from pipeline.transport.security import ServerGate
from pipeline.transport.topology import internal_address

MT = wire.MessageType
MAX_REPORTS_PER_STEP = 4096  # writer and tokenizer reports read in one step
IDLE_WAIT_S = 0.2  # the longest wait for a message when nothing waits for a ring


class FrontStage(Stage[FrontStageSettings]):
    name = "front"
    poller: zmq.Poller  # made by open()
    poll_ms = 20

    def open(self) -> None:
        settings = self.settings
        self.data_dir = DataDir(settings.data_path)
        self.registry = JobRegistry(settings.data_path)
        self.catalog = ModelCatalog.from_settings(settings)
        self.reuse = ReuseFinder(  # `submit --reuse` jobs; digests local workers' weights
            settings.data_path, settings.models, settings.worker_groups, settings.fleet
        )
        self.chunk_timeout_s = settings.ingest.chunk_timeout_s
        self.limits = wire.WireLimits(max_bytes=settings.ingest.max_message_bytes)
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        # SNDTIMEO 0: a gone producer never blocks the front. RCVHWM 2: two whole messages
        # wait per connection at most; with 1, a CURVE connection's first message never
        # reaches the front (tests/test_auth.py)
        self.producers = wire.open_socket(self.context, zmq.ROUTER, recv_hwm=2)
        self.producers.setsockopt(zmq.MAXMSGSIZE, settings.ingest.max_message_bytes)
        self.gate.secure(self.producers)
        self.producers.bind(settings.ingest.bind)
        self.guard = PeerGuard(
            self.producers,
            settings.ingest.max_connections,
            settings.ingest.max_peer_connections,
            self.log,
        )
        self.inflight = InflightChunks.from_settings(settings.ingest)
        inbox = wire.open_socket(self.context, zmq.PULL, bind=internal_address(settings, "front"))
        self.inbox = wire.Inbox(inbox, self.log, "a writer or tokenizer")
        self.tokenize = wire.open_socket(
            self.context, zmq.PUSH, send_hwm=4, bind=internal_address(settings, "tokenize")
        )
        self.outlet = Outlet(self.context, settings, "front-0", "router")
        self.poller = zmq.Poller()
        self.poller.register(self.producers, zmq.POLLIN)
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(self.guard.monitor, zmq.POLLIN)
        self.forwarding = ChunkForwarding(self.tokenize, self.outlet, self.inflight)
        self.replies = ProducerReplies(self.log)  # sent after the step's journal sync
        self.jobs_by_no: dict[int, Job] = {}
        self.life = time.monotonic_ns()  # this front's life, in the accept records it writes
        # a retried chunk an earlier front of this broker life sent on waits here until that
        # try can no longer land (ingest/parked_chunks.py)
        self.parked = ParkedChunks(self.epoch, self.life)
        self.stopping = False
        self.disk = FullDisk(self.log, "chunks are refused, retryably")

    # ---- the loop ------------------------------------------------------------------------
    def step(self, now: float) -> None:
        events = dict(self.poller.poll(self._wait_ms(now)))
        self.guard.step(now)  # cut connections over the caps before they are read
        if self.inbox.socket in events:
            self._read_inbox()
        accepting = not self.stopping and not self.forwarding.waiting and not self.inflight.full
        fresh: list[Inflight] = []
        if accepting and self.parked:
            fresh += self._unpark(now)
        if accepting and self.producers in events:
            refuse = lambda route, reason: self.replies.add(route, MT.ERROR, {"reason": reason})  # noqa: E731
            for message in wire.requests(
                self.producers, 16, self.limits, self.log, "producer", refuse
            ):
                started = self._handle(message, now)
                if started is not None:
                    fresh.append(started)
        self._expire(now)
        self._commit_ready()
        try:
            self._flush_journals(now)  # accepts and commits of this step: one group commit
        except FabricError as exc:
            self._flush_failed(exc, fresh)
            fresh = []
        for flight in fresh:
            self.forwarding.queue(flight)
        self.forwarding.send_on()
        self.replies.send(self.producers)
        self._unload_finished()
        self.disk.settle(now)

    def _wait_ms(self, now: float) -> int:
        """How long the step may wait for a message: `poll_ms` while records wait for room in
        a ring, else up to IDLE_WAIT_S (deadlines are seconds long) or a parked chunk's time.
        Messages wake it at once, so an idle front wakes 5 times a second, not 50."""
        if self.forwarding.waiting:
            return self.poll_ms
        due = now + IDLE_WAIT_S
        if (parked := self.parked.next_s()) is not None:
            due = min(due, parked)
        return max(0, int((due - now) * 1000))

    # ---- requests from producers ------------------------------------------------------------
    def _handle(self, message: wire.Message, now: float) -> Inflight | None:
        route, meta = message.route, message.meta
        if message.type == MT.HELLO:
            self.replies.add(route, MT.CATALOG, front_answers.catalog(self.settings, self.catalog))
        elif message.type == MT.JOB_STATUS:
            job_id = str(meta.get("job", ""))
            self.replies.add(route, MT.JOB_INFO, front_answers.job_info(self.registry, job_id))
        elif message.type == MT.SUBMIT_CHUNK:
            try:
                return self._submit(message, now)
            except IngestError as exc:
                self.replies.refuse(route, meta, str(exc))
            except DiskFullError as exc:  # creating the job's files: the producer retries
                self.log.warning("job %r: %s", meta.get("job"), exc)
                error = front_answers.chunk_error(meta, str(exc))
                self.replies.add(route, MT.CHUNK_ERROR, error, wire.Flag.RETRYABLE)
            except WireError as exc:
                self.replies.refuse(route, meta, f"malformed chunk: {exc}")
            except Exception:  # a bug must not turn one chunk into a crash loop
                self.log.exception("internal error on a chunk of job %r", meta.get("job"))
                self.replies.refuse(
                    route, meta, "internal error in the broker (logged); please report it"
                )
        else:
            self.replies.add(
                route, MT.ERROR, {"reason": f"the front does not take {message.type.name} messages"}
            )
        return None

    def _submit(self, message: wire.Message, now: float) -> Inflight | None:
        meta, route = message.meta, message.route
        job_id, number = check_job_id(str(meta["job"])), int(meta["chunk"])
        chunk_lines = int(meta.get("chunk_lines", 0))
        deliver = parse_deliver(meta.get("deliver", DELIVER_FILE))
        job = self.registry.get(job_id)
        if job is None:
            if chunk_lines < 1:
                raise IngestError(f"chunk_lines {chunk_lines} must be a positive number of lines")
            source = str(meta.get("source", ""))[:4096]  # the input file's path, for vectors search
            deadline = parse_deadline_field(meta.get("deadline"))  # the first chunk's counts
            priority = parse_priority_field(meta.get("job_priority", 0))
            notify = str(meta.get("notify", ""))[:4096]  # where its end is POSTed, if anywhere
            limits = parse_limits_field(meta.get("limits"))  # likewise
            job = self.registry.create(
                job_id,
                chunk_lines,
                deliver,
                source,
                deadline,
                priority=priority,
                notify=notify,
                limits=limits,
                reuse=meta.get("reuse") is True,  # `submit --reuse`: the first chunk's counts
            )
        self.jobs_by_no[job.job_no] = job
        job.check_takes(deliver, chunk_lines)
        state = job.chunks.get(number)
        if state is not None and state.committed is not None:
            if job.commit_pending(number):  # its commit is not on disk yet (a full disk?)
                reason = "the chunk is stored but not yet recorded durably; send it again"
                self.replies.retry(route, job_id, number, reason)
            else:
                ack = front_answers.chunk_ack(job, number, duplicate=True)
                self.replies.add(route, MT.CHUNK_ACK, *ack)
            return None
        flight = self.inflight.get((job.job_no, number))
        if flight is not None:
            flight.route = route  # answer the latest sender
            return None
        if self._park(job, number, state, message, now):
            return None
        nbytes = sum(a.nbytes for a in message.arrays.values())
        busy = self.inflight.busy(route, nbytes)
        if busy is not None:
            self.replies.retry(route, job_id, number, busy)
            return None
        chunk = chunk_from_wire(meta, message.arrays)
        first = number * job.chunk_lines + 1
        if (
            chunk.index != number
            or chunk.first_line != first
            or chunk.last_line >= first + job.chunk_lines
        ):
            raise IngestError(
                f"chunk {number} of job {job_id} must cover lines {first}..{first + job.chunk_lines - 1}, "
                f"not {chunk.first_line}..{chunk.last_line}"
            )
        checked = self._check(job, chunk, state, chunk_digests(message.arrays))
        chunk, already, reuse = checked.chunk, checked.already, None
        if job.reuse:  # lines the reuse index answers leave the chunk here (ingest/reuse_keys.py)
            sent, reuse = self.reuse.take(chunk)
            if reuse.reused:
                ids = dict(zip(chunk.line.tolist(), chunk.custom_ids, strict=True))
                already = sorted(already + [(r[0], ids[r[0]]) for r in reuse.reused])
            chunk = sent
        deadline_ns = round((now + self.chunk_timeout_s) * 1e9)  # `now` is CLOCK_MONOTONIC
        flight = Inflight(
            job=job,
            chunk=chunk,
            final=bool(meta.get("final", False)),
            route=route,
            deadline_s=now + self.chunk_timeout_s + DEADLINE_MARGIN_S,
            deadline_ns=deadline_ns,
            expected=None if chunk.needs_tokenizing else chunk.n_items,
            already=already,
            digests=checked.digests,
            written=checked.written,
            nbytes=nbytes,
            reuse=reuse,
        )
        landing = Landing(self.epoch, self.life, deadline_ns)
        job.accept(number, chunk.first_line, chunk.last_line, landing=landing)  # every try
        self.registry.touch(job)
        self.inflight.add(flight)
        return flight

    def _park(
        self, job: Job, number: int, earlier: ChunkEntry | None, message: wire.Message, now: float
    ) -> bool:
        """Hold a retried chunk while a try that an earlier front of this broker life sent on
        may still land (ingest/parked_chunks.py). True when the chunk waits."""
        key = (job.job_no, number)
        again = key in self.parked  # sent again while it waits: the latest sender
        waits = self.parked.hold(key, earlier, message, now)
        if waits is not None and not again:
            self.log.info(
                "job %s chunk %d: an earlier front's try may still land for %.1f s; it waits",
                job.job_id,
                number,
                waits,
            )
        return waits is not None

    def _unpark(self, now: float) -> list[Inflight]:
        """The parked chunks whose earlier try can no longer land, handled as just received."""
        started = [self._handle(message, now) for message in self.parked.due(now)]
        return [flight for flight in started if flight is not None]

    def _check(self, job: Job, chunk: InputChunk, earlier, hashed: Digests) -> Checked:
        """Check the chunk again, and find what an earlier attempt already stored."""
        stored = None
        if earlier is not None:  # accepted before and never committed: some items may be stored
            stored = stored_by_earlier_try(self.data_dir, job.job_no, chunk, earlier.accepted_ns)
        in_flight = self.inflight.digests_of_job(job, chunk.index)
        checked = recheck(chunk, self.catalog, job.custom_ids, in_flight, stored, hashed)
        if checked.already:
            self.log.info(
                "job %s chunk %d: %d items already in the log from an earlier attempt",
                job.job_id,
                chunk.index,
                len(checked.already),
            )
        return checked

    # ---- reports from writers and tokenizers ------------------------------------------------------
    def _read_inbox(self) -> None:
        for message in self.inbox.read(MAX_REPORTS_PER_STEP):
            meta = message.meta
            flight = self.inflight.get((int(meta.get("job_no", -1)), int(meta.get("chunk", -1))))
            if flight is None:
                continue  # late news of a chunk that already failed or finished
            if message.type == MT.APPEND_ACK:
                flight.count_acked(message.arrays.get("index"), int(meta["count"]))
            elif message.type == MT.TOKENIZED:
                if meta.get("failed"):
                    self._fail(flight, f"tokenizing failed: {meta['failed']}", retryable=True)
                    continue
                flight.expected = int(meta["forwarded"])
                try:
                    flight.errors.extend(
                        LineError(int(a), b, str(c), str(d)) for a, b, c, d in meta["errors"]
                    )
                    flight.errors.extend(errors_from_wire(message.arrays))
                except WireError as exc:
                    self._fail(flight, f"a tokenizer's report is malformed: {exc}", True)
            elif message.type == MT.ERROR:
                self._fail(flight, str(meta.get("reason")), retryable=message.retryable)

    def _commit_ready(self) -> None:
        for flight in self.inflight.complete():
            flight.job.commit(flight.chunk.index, **flight.commit_record())
            self.registry.touch(flight.job)
            self.inflight.remove(flight)
            ack = front_answers.chunk_ack(flight.job, flight.chunk.index)
            self.replies.add(flight.route, MT.CHUNK_ACK, *ack)

    def _expire(self, now: float) -> None:
        for flight in self.inflight.expired(now):
            self._fail(
                flight,
                "the chunk timed out inside the broker (a stage restarted?); send it again",
                True,
            )

    def _fail(self, flight: Inflight, reason: str, retryable: bool) -> None:
        self.inflight.remove(flight)
        self.log.warning(
            "job %s chunk %d failed: %s", flight.job.job_id, flight.chunk.index, reason
        )
        meta = {"job": flight.job.job_id, "chunk": flight.chunk.index, "reason": reason}
        self.replies.add(
            flight.route, MT.CHUNK_ERROR, meta, wire.Flag.RETRYABLE if retryable else 0
        )

    def _flush_journals(self, now: float) -> None:
        """Sync the job journals; on a full disk, one try a second (the rest fail at once)."""
        if not self.registry.dirty:
            return
        if not self.disk.ready(now):
            raise DiskFullError(self.disk.reason)
        try:
            self.registry.flush()
        except DiskFullError as exc:
            self.disk.failed(exc, now)
            raise
        self.disk.succeeded(now)

    def _flush_failed(self, exc: Exception, fresh: list[Inflight]) -> None:
        """The journal could not be synced (a full disk): nothing waiting on it may be answered."""
        if not isinstance(exc, DiskFullError):  # that one is logged once, by self.disk
            self.log.error("job journal sync failed: %s", exc)
        for flight in fresh:
            self._fail(flight, f"the broker could not record the chunk: {exc}", retryable=True)
        self.replies.journal_failed(exc)

    def _unload_finished(self) -> None:
        """Forget jobs that take no more input, so memory follows the jobs being submitted."""
        if not self.jobs_by_no:
            return
        busy = self.inflight.job_numbers()
        for job_no, job in list(self.jobs_by_no.items()):
            if (
                job.state != JobState.VALIDATING
                and job_no not in busy
                and self.registry.unload(job)
            ):
                del self.jobs_by_no[job_no]

    # ---- life ------------------------------------------------------------------------------
    def stats(self, now: float) -> dict:
        """Its full-disk figures (docs/metrics.md); the front has no other."""
        return self.disk.figures(self.label)

    def drain(self, deadline: float) -> None:
        """Stop taking chunks; finish those in flight while the stages behind are still up."""
        self.stopping = True
        while self.inflight and time.monotonic() < deadline:
            self.step(time.monotonic())

    def close(self) -> None:
        self.registry.close()
        self.outlet.close()
        self.guard.close()
        for sock in (self.producers, self.inbox.socket, self.tokenize):
            sock.close(0)
        self.gate.close()
        self.context.term()
