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
and in all (a chunk past a cap is refused, retryably), and connections per
address and in all (ingest/peer_guard.py: libzmq buffers a frame whole
before the front sees it, so only the number of connections bounds that).

A chunk that does not complete by its deadline (a stage died and its rings
were replaced, a disk stalled) is answered with a retryable error; writers
drop records past that deadline. A retried chunk that was accepted before is
reconciled: items already in the log are counted, not stored again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ingest.catalog import ModelCatalog
from ingest.chunk_check import Checked, recheck
from ingest.chunk_wire import chunk_from_wire, chunk_to_wire
from ingest.error_wire import errors_from_wire, errors_to_wire
from ingest.input_chunk import InputChunk
from ingest.jobs import DELIVER_FILE, Job, JobRegistry, parse_deliver
from ingest.line_errors import (
    LineError,
)
from ingest.peer_guard import PeerGuard
from ingest.reconcile import stored_indexes
from ingest.tokenizer_stage import items_of
from pipeline import wire
from pipeline.batches import put_items, split_items
from pipeline.datadir import DataDir
from pipeline.disk_full import FullDisk
from pipeline.errors import DiskFullError, FabricError, IngestError, WireError
from pipeline.job_files import check_job_id
from pipeline.outlet import Outlet
from pipeline.security import ServerGate
from pipeline.stage import Stage
from pipeline.topology import internal_address

MT = wire.MessageType
DEADLINE_MARGIN_S = 5.0  # the front waits this much past the writers' deadline


@dataclass
class Inflight:
    job: Job
    chunk: InputChunk
    final: bool
    route: tuple[bytes, ...]
    deadline_s: float
    deadline_ns: int
    expected: int | None  # items sent on; None until a tokenizer reports
    already: list[tuple[int, str]] = field(default_factory=list)  # (line, custom_id) stored before
    acked: int = 0
    errors: list[LineError] = field(default_factory=list)
    sent: bool = False
    pieces: deque | None = None  # records still to put into the router's ring
    digests: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    nbytes: int = 0  # the chunk's arrays as received, for ingest.*inflight_bytes

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.job_no, self.chunk.index)

    @property
    def complete(self) -> bool:
        return self.sent and self.expected is not None and self.acked >= self.expected


def error_list(errors: list[LineError]) -> list[list[Any]]:
    return [[e.line, e.custom_id, e.code, e.message] for e in errors]


class FrontStage(Stage):
    name = "front"
    poll_ms = 20

    def open(self) -> None:
        settings = self.settings
        self.data_dir = DataDir(settings.data_path)
        self.registry = JobRegistry(settings.data_path)
        self.catalog = ModelCatalog.from_settings(settings)
        self.chunk_timeout_s = settings.ingest.chunk_timeout_s
        self.max_in_flight = settings.ingest.max_chunks_in_flight
        self.producer_in_flight = settings.ingest.producer_chunks_in_flight
        self.limits = wire.WireLimits(max_bytes=settings.ingest.max_message_bytes)
        self.context = zmq.Context()
        self.gate = ServerGate(self.context, settings.security)  # CURVE, when keys are set
        self.producers = self.context.socket(zmq.ROUTER)
        self.producers.setsockopt(zmq.LINGER, 0)
        self.producers.setsockopt(zmq.SNDTIMEO, 0)  # a gone producer never blocks the front
        self.producers.setsockopt(zmq.MAXMSGSIZE, settings.ingest.max_message_bytes)
        # two whole messages wait per connection at most: with 1, a CURVE connection's first
        # message never reaches the front (tests/test_auth.py)
        self.producers.setsockopt(zmq.RCVHWM, 2)
        self.gate.secure(self.producers)
        self.producers.bind(settings.ingest.bind)
        self.guard = PeerGuard(
            self.producers,
            settings.ingest.max_connections,
            settings.ingest.max_peer_connections,
            self.log,
        )
        self.max_inflight_bytes = settings.ingest.max_inflight_bytes
        self.producer_inflight_bytes = settings.ingest.producer_inflight_bytes
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(internal_address(settings, "front"))
        self.tokenize = self.context.socket(zmq.PUSH)
        self.tokenize.setsockopt(zmq.LINGER, 0)
        self.tokenize.setsockopt(zmq.SNDHWM, 4)
        self.tokenize.setsockopt(zmq.SNDTIMEO, 0)
        self.tokenize.bind(internal_address(settings, "tokenize"))
        self.outlet = Outlet(self.context, settings, "front-0", "router")
        self.poller = zmq.Poller()
        self.poller.register(self.producers, zmq.POLLIN)
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.guard.monitor, zmq.POLLIN)
        self.inflight: dict[tuple[int, int], Inflight] = {}
        self.unsent: deque[Inflight] = deque()
        self.replies: list[tuple[tuple[bytes, ...], MT, dict[str, Any], int, Any]] = []
        self.jobs_by_no: dict[int, Job] = {}
        self.stopping = False
        self.disk = FullDisk(self.log, "chunks are refused, retryably")

    # ---- the loop ------------------------------------------------------------------------
    def step(self, now: float) -> None:
        events = dict(self.poller.poll(self.poll_ms))
        self.guard.step(now)  # cut connections over the caps before they are read
        if self.inbox in events:
            self._read_inbox()
        accepting = (
            not self.stopping and not self.unsent and len(self.inflight) < self.max_in_flight
        )
        fresh: list[Inflight] = []
        if accepting and self.producers in events:
            refuse = lambda route, reason: self._reply(route, MT.ERROR, {"reason": reason})  # noqa: E731
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
            self.unsent.append(flight)
        self._send_on()
        self._send_replies()
        self._unload_finished()
        self.disk.settle(now)

    # ---- requests from producers ------------------------------------------------------------
    def _handle(self, message: wire.Message, now: float) -> Inflight | None:
        route, meta = message.route, message.meta
        if message.type == MT.HELLO:
            self._reply(route, MT.CATALOG, self._catalog())
        elif message.type == MT.JOB_STATUS:
            self._reply(route, MT.JOB_INFO, self._job_info(str(meta.get("job", ""))))
        elif message.type == MT.SUBMIT_CHUNK:
            try:
                return self._submit(message, now)
            except IngestError as exc:
                self._refuse(route, meta, str(exc))
            except DiskFullError as exc:  # creating the job's files: the producer retries
                self.log.warning("job %r: %s", meta.get("job"), exc)
                self._reply(
                    route,
                    MT.CHUNK_ERROR,
                    {
                        "job": str(meta.get("job", "")),
                        "chunk": _int(meta.get("chunk")),
                        "reason": str(exc),
                    },
                    wire.Flag.RETRYABLE,
                )
            except WireError as exc:
                self._refuse(route, meta, f"malformed chunk: {exc}")
            except Exception:  # a bug must not turn one chunk into a crash loop
                self.log.exception("internal error on a chunk of job %r", meta.get("job"))
                self._refuse(route, meta, "internal error in the broker (logged); please report it")
        else:
            self._reply(
                route, MT.ERROR, {"reason": f"the front does not take {message.type.name} messages"}
            )
        return None

    def _catalog(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "models": [
                {
                    "name": m.name,
                    "engine": m.engine,
                    "tokenizer": m.tokenizer,
                    "max_tokens": m.max_tokens,
                    "endpoints": list(m.endpoints),
                    # as resolved here (ingest.catalog), so the producer refuses the same ids
                    "vocab_size": self.catalog.models[m.name].vocab_size or 0,
                }
                for m in settings.models
            ],
            "lanes": list(settings.broker.lanes),
            "chunk_items": settings.ingest.chunk_items,
            "max_message_bytes": settings.ingest.max_message_bytes,
        }

    def _job_info(self, job_id: str) -> dict[str, Any]:
        try:
            job = self.registry.get(job_id)
        except IngestError as exc:
            return {"job": job_id, "exists": False, "reason": str(exc)}
        if job is None:
            return {"job": job_id, "exists": False}
        committed = sorted(c for c, s in job.chunks.items() if s.committed is not None)
        return {
            **job.summary(),
            "job": job_id,
            "exists": True,
            "chunk_lines": job.chunk_lines,
            "committed": committed,
        }

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
            job = self.registry.create(job_id, chunk_lines, deliver, source)
        self.jobs_by_no[job.job_no] = job
        if deliver != job.deliver:
            raise IngestError(
                f"job {job_id} was submitted with --deliver {job.deliver}, this chunk says "
                f"{deliver}; resume it with the same --deliver"
            )
        if chunk_lines != job.chunk_lines:
            raise IngestError(
                f"job {job_id} was started with chunks of {job.chunk_lines} lines, this chunk says "
                f"{chunk_lines}; resume it with the same chunk size"
            )
        if job.state not in ("validating", "queued"):
            raise IngestError(f"job {job_id} is {job.state}; it takes no more input")
        state = job.chunks.get(number)
        if state is not None and state.committed is not None:
            if job.commit_pending(number):  # its commit is not on disk yet (a full disk?)
                reason = "the chunk is stored but not yet recorded durably; send it again"
                self._reply(
                    route,
                    MT.CHUNK_ERROR,
                    {"job": job_id, "chunk": number, "reason": reason},
                    wire.Flag.RETRYABLE,
                )
            else:
                self._reply(route, MT.CHUNK_ACK, *self._ack(job, number, duplicate=True))
            return None
        flight = self.inflight.get((job.job_no, number))
        if flight is not None:
            flight.route = route  # answer the latest sender
            return None
        if sum(1 for f in self.inflight.values() if f.route == route) >= self.producer_in_flight:
            reason = (
                f"this producer already has {self.producer_in_flight} chunks in flight "
                "(ingest.producer_chunks_in_flight); send it again when one is answered"
            )
            self._reply(
                route,
                MT.CHUNK_ERROR,
                {"job": job_id, "chunk": number, "reason": reason},
                wire.Flag.RETRYABLE,
            )
            return None
        nbytes = sum(a.nbytes for a in message.arrays.values())
        busy = self._too_many_bytes(route, nbytes)
        if busy is not None:
            self._reply(
                route,
                MT.CHUNK_ERROR,
                {"job": job_id, "chunk": number, "reason": busy},
                wire.Flag.RETRYABLE,
            )
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
        checked = self._check(job, chunk, state)
        chunk = checked.chunk
        deadline_ns = time.monotonic_ns() + int(self.chunk_timeout_s * 1e9)
        flight = Inflight(
            job=job,
            chunk=chunk,
            final=bool(meta.get("final", False)),
            route=route,
            deadline_s=now + self.chunk_timeout_s + DEADLINE_MARGIN_S,
            deadline_ns=deadline_ns,
            expected=None if chunk.needs_tokenizing else chunk.n_items,
            already=checked.already,
            digests=checked.digests,
            nbytes=nbytes,
        )
        if state is None:
            job.accept(number, chunk.first_line, chunk.last_line)
            self.registry.touch(job)
        self.inflight[flight.key] = flight
        return flight

    def _too_many_bytes(self, route: tuple[bytes, ...], nbytes: int) -> str | None:
        """Why a chunk of `nbytes` must wait (retryably), or None. A connection holding nothing
        may always send one chunk, so a chunk larger than a cap is never refused for ever."""
        mine = sum(f.nbytes for f in self.inflight.values() if f.route == route)
        total = sum(f.nbytes for f in self.inflight.values())
        if mine and mine + nbytes > self.producer_inflight_bytes:
            return (
                f"this producer already has {mine} bytes of chunks in flight "
                f"(ingest.producer_inflight_bytes = {self.producer_inflight_bytes}); "
                "send it again when one is answered"
            )
        if total and total + nbytes > self.max_inflight_bytes:
            return (
                f"the front holds {total} bytes of chunks in flight "
                f"(ingest.max_inflight_bytes = {self.max_inflight_bytes}); send it again later"
            )
        return None

    def _check(self, job: Job, chunk: InputChunk, earlier) -> Checked:
        """Check the chunk again, and find what an earlier attempt already stored."""
        stored = None
        if earlier is not None:  # accepted before and never committed: some items may be stored
            stored = stored_indexes(
                self.data_dir,
                job.job_no,
                chunk.first_line - 1,
                chunk.last_line - 1,
                earlier.accepted_ns,
            )
        in_flight = [
            f.digests[0]
            for f in self.inflight.values()
            if f.job is job and f.chunk.index != chunk.index
        ]
        checked = recheck(chunk, self.catalog, job.custom_ids, in_flight, stored)
        if checked.already:
            self.log.info(
                "job %s chunk %d: %d items already in the log from an earlier attempt",
                job.job_id,
                chunk.index,
                len(checked.already),
            )
        return checked

    # ---- forwarding ------------------------------------------------------------------------
    def _send_on(self) -> None:
        while self.unsent:
            flight = self.unsent[0]
            if flight.key not in self.inflight:  # failed meanwhile
                self.unsent.popleft()
                continue
            if not self._send_one(flight):
                return
            flight.sent = True
            self.unsent.popleft()

    def _send_one(self, flight: Inflight) -> bool:
        to_send = flight.chunk
        if to_send.n_items == 0:
            flight.expected = 0
            return True
        if to_send.needs_tokenizing:
            meta, arrays = chunk_to_wire(to_send)
            meta.update(job_no=flight.job.job_no, deadline_ns=flight.deadline_ns)
            try:
                wire.send(self.tokenize, MT.TOKENIZE, meta, arrays)
            except WireError:
                return False  # tokenizers busy (or none up yet): try again next step
            return True
        if flight.pieces is None:
            flight.pieces = deque(
                split_items(items_of(to_send, flight.job.job_no, flight.deadline_ns))
            )
        router = to_send.index % len(self.outlet)
        while flight.pieces:
            if not self.outlet.try_put(router, put_items, flight.pieces[0]):
                return False
            flight.pieces.popleft()
        return True

    # ---- reports from writers and tokenizers ------------------------------------------------------
    def _read_inbox(self) -> None:
        while True:
            try:
                message = wire.recv(self.inbox, 0)
            except WireError as exc:
                self.log.error("dropped a malformed internal message: %s", exc)
                continue
            if message is None:
                return
            meta = message.meta
            flight = self.inflight.get((int(meta.get("job_no", -1)), int(meta.get("chunk", -1))))
            if flight is None:
                continue  # late news of a chunk that already failed or finished
            if message.type == MT.APPEND_ACK:
                flight.acked += int(meta["count"])
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
        for flight in [f for f in self.inflight.values() if f.complete]:
            chunk = flight.chunk
            errors = sorted([*chunk.errors, *flight.errors], key=lambda e: e.line)
            rejected = {e.line for e in flight.errors}
            if rejected or flight.already:
                pairs = [
                    (int(line), custom_id)
                    for line, custom_id in zip(chunk.line.tolist(), chunk.custom_ids, strict=True)
                    if line not in rejected
                ]
                pairs = sorted(pairs + flight.already)
                lines, ids = [line for line, _ in pairs], [custom_id for _, custom_id in pairs]
            else:  # the usual case: every item forwarded was stored, already in line order
                lines, ids = chunk.line.tolist(), list(chunk.custom_ids)
            flight.job.commit(
                chunk.index,
                lines,
                ids,
                flight.acked + len(flight.already),
                error_list(errors),
                flight.final,
                digests=flight.digests if not (rejected or flight.already) else None,
            )
            self.registry.touch(flight.job)
            del self.inflight[flight.key]
            self._reply(flight.route, MT.CHUNK_ACK, *self._ack(flight.job, chunk.index))

    def _ack(
        self, job: Job, number: int, duplicate: bool = False
    ) -> tuple[dict[str, Any], int, dict[str, np.ndarray]]:
        """CHUNK_ACK's meta, flags and arrays: the rejected lines go as compact arrays, so the
        answer fits its limits however many lines the chunk had rejected."""
        record = job.chunks[number].committed
        meta = {
            "job": job.job_id,
            "chunk": number,
            "stored": record["stored"],
            "rejected": len(record["errors"]),
            "duplicate": duplicate,
            "state": job.state,
        }
        errors = (LineError(int(a), b, str(c), str(d)) for a, b, c, d in record["errors"])
        return meta, 0, errors_to_wire(errors)

    def _expire(self, now: float) -> None:
        for flight in [f for f in self.inflight.values() if now > f.deadline_s]:
            self._fail(
                flight,
                "the chunk timed out inside the broker (a stage restarted?); send it again",
                True,
            )

    def _fail(self, flight: Inflight, reason: str, retryable: bool) -> None:
        self.inflight.pop(flight.key, None)
        self.log.warning(
            "job %s chunk %d failed: %s", flight.job.job_id, flight.chunk.index, reason
        )
        meta = {"job": flight.job.job_id, "chunk": flight.chunk.index, "reason": reason}
        self._reply(flight.route, MT.CHUNK_ERROR, meta, wire.Flag.RETRYABLE if retryable else 0)

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
        self.replies = [
            (
                route,
                MT.CHUNK_ERROR,
                {"job": m["job"], "chunk": m["chunk"], "reason": str(exc)},
                wire.Flag.RETRYABLE,
                None,
            )
            if t == MT.CHUNK_ACK and not m.get("duplicate")
            else (route, t, m, f, a)
            for route, t, m, f, a in self.replies
        ]

    def _unload_finished(self) -> None:
        """Forget jobs that take no more input, so memory follows the jobs being submitted."""
        if not self.jobs_by_no:
            return
        busy = {f.job.job_no for f in self.inflight.values()}
        for job_no, job in list(self.jobs_by_no.items()):
            if job.state != "validating" and job_no not in busy and self.registry.unload(job):
                del self.jobs_by_no[job_no]

    # ---- answers ----------------------------------------------------------------------------
    def _refuse(self, route: tuple[bytes, ...], meta: dict[str, Any], reason: str) -> None:
        self.log.warning("refused a chunk: %s", reason)
        self._reply(
            route,
            MT.CHUNK_ERROR,
            {"job": str(meta.get("job", "")), "chunk": _int(meta.get("chunk")), "reason": reason},
        )

    def _reply(
        self,
        route,
        msg_type: MT,
        meta: dict[str, Any],
        flags: int = 0,
        arrays: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.replies.append((route, msg_type, meta, flags, arrays))

    def _send_replies(self) -> None:
        for route, msg_type, meta, flags, arrays in self.replies:
            try:
                wire.send(self.producers, msg_type, meta, arrays, route=route, flags=flags)
            except WireError as exc:
                self.log.info("could not answer a producer (gone?): %s", exc)
        self.replies = []

    # ---- life ------------------------------------------------------------------------------
    def drain(self, deadline: float) -> None:
        """Stop taking chunks; finish those in flight while the stages behind are still up."""
        self.stopping = True
        while self.inflight and time.monotonic() < deadline:
            self.step(time.monotonic())

    def close(self) -> None:
        self.registry.close()
        self.outlet.close()
        self.guard.close()
        for sock in (self.producers, self.inbox, self.tokenize):
            sock.close(0)
        self.gate.close()
        self.context.term()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
