"""The segment writer stage: append what the routers send, group-commit, acknowledge.

Each writer owns the keys (model, shape, lane) that hash to it, one
SegmentAppender per key. A step takes every KEYED record waiting in its
rings (up to MAX_RECORDS_PER_STEP), appends them, releases the rings, and
hands every segment it touched to its sync thread (router/sync_thread.py:
one fdatasync each, group commit). While the disk syncs step k, step k+1
appends the records that arrived meanwhile (the in-flight sync is its
group-commit window); step k's chunks are answered (APPEND_ACK: how many
items of which chunk are durable) only once its ticket is back, and step
k+1's segments are handed over only then: one sync in flight, in order.
So the disk does not idle while the writer appends, nor the writer while
the disk syncs. With no sync in flight, `writers.flush_ms` is the window.

A record whose deadline has passed is dropped unappended: the front has
given up on that chunk and its producer will retry it. A full disk answers
the chunk with a retryable error (nothing of a failed append is stored, and
a failed sync fails exactly the chunks of its step; the next step's appends
go on and its sync tries those segments again), logged once, not once per
chunk (pipeline/store/disk_full.py); with nothing to append it probes the disk
once a second, so "disk writable again" is said once space is freed whether
or not more work comes.

Threads: the writer's thread owns the appenders and segments; the sync
thread only fdatasyncs the descriptors of the ticket it holds, and the
writer closes none of them before the ticket is back (the hand-off rule is
in router/sync_thread.py).

Stage logic takes its clock from `step(now)` (CLOCK_MONOTONIC seconds): a
record's deadline and the full-disk episode are judged on it, so a test can
drive a writer on a clock of its own. Real time is used on purpose for the
group-commit window (a real wait for more records or for the disk; records
it takes are judged on the step's `now`) and the fsync latency it measures.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import zmq

from config.stage_settings import WriterStageSettings
from pipeline.core.errors import DiskFullError, FabricError
from pipeline.core.idle_wait import IdleWait
from pipeline.core.item_seq import seq_of
from pipeline.process.stage import Stage
from pipeline.store.datadir import DataDir
from pipeline.store.disk_full import FullDisk, probe
from pipeline.store.segment import Segment
from pipeline.store.segment_append import SegmentAppender, SegmentIds
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.telemetry.metric_catalogue import FSYNC_BUCKETS_S
from pipeline.telemetry.metrics import Histogram
from pipeline.transport import wire
from pipeline.transport.ring_port import RingPort
from pipeline.transport.ring_records import KEYED, Keyed, read_keyed
from pipeline.transport.topology import internal_address, rings_to
from router.sync_thread import SyncThread, Ticket

MAX_RECORDS_PER_STEP = 256
Chunk = tuple[int, int]  # (job_no, chunk)
NEVER_NS = 2**63  # a deadline later than any


@dataclass
class StepAppends:
    """What one step appended, answered once its sync is back."""

    durable: dict[Chunk, int] = field(default_factory=lambda: defaultdict(int))  # items placed
    index: dict[Chunk, list] = field(default_factory=lambda: defaultdict(list))  # which ones
    failed: dict[Chunk, str] = field(default_factory=dict)  # chunk -> why refused
    placed: dict[int, int] = field(default_factory=dict)  # segment id -> end of what it placed
    syncs: list = field(default_factory=list)  # (appender, its begin_sync list)

    def __bool__(self) -> bool:
        return bool(self.durable or self.failed)


class WriterStage(Stage[WriterStageSettings]):
    name = "writer"
    poller: zmq.Poller  # made by open()
    poll_ms = 50

    def open(self) -> None:
        settings = self.settings
        self.data_dir = DataDir(settings.data_path).ensure()
        self.ids = SegmentIds(self.data_dir)
        self.lanes = frozenset(settings.broker.lanes)
        self.appenders: dict[tuple[str, int, int], SegmentAppender] = {}
        self.ports = [RingPort(r.name) for r in rings_to(settings, self.label)]
        self.idle = IdleWait(self.poll_ms)  # how long an idle step waits for a wakeup
        self.context = zmq.Context()
        wakeups = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(settings, self.label)
        )
        self.wakeups = wire.Inbox(wakeups, self.log, "a router")
        self.acks = wire.open_socket(
            self.context,
            zmq.PUSH,
            linger_ms=1000,
            send_timeout_ms=1000,
            connect=internal_address(settings, "front"),
        )
        # new work: (segment, end) after each sync
        self.dispatch = wire.open_socket(
            self.context, zmq.PUSH, connect=internal_address(settings, "dispatch")
        )
        self.appended = 0
        self.syncer = SyncThread(f"writer-{self.index}-sync")
        self.poller = zmq.Poller()  # a wakeup (records waiting) or the disk (a sync back)
        self.poller.register(self.wakeups.socket, zmq.POLLIN)
        self.poller.register(self.syncer.fd, zmq.POLLIN)
        self.flush_s = settings.writers.flush_ms / 1000
        self.appended_by_key: Counter = Counter()  # (model, lane) -> items appended (metrics)
        self.fsync_s = Histogram(FSYNC_BUCKETS_S)  # one group commit per observation
        self.disk = FullDisk(self.log, "chunks that need new space are refused, retryably")
        # (job_no, chunk, deadline_ns) -> item indices this life appended for that try (sorted)
        self.tries: dict[tuple[int, int, int], np.ndarray] = {}
        self.tries_due_ns = NEVER_NS  # the earliest deadline among them: when to forget some

    def _appender(self, key: tuple[str, int, int]) -> SegmentAppender:
        appender = self.appenders.get(key)
        if appender is None:
            model, shape, lane = key
            appender = SegmentAppender(
                self.data_dir,
                SegmentKey(KIND_INPUT, model, shape, lane),
                slot_bytes_for(lane * 4),
                self.settings.broker.segment_bytes,
                self.ids,
                self.settings.broker.segment_idle_s,
                self.settings.writers.drop_synced_pages,
                self.settings.broker.segment_min_bytes,
            )
            self.appenders[key] = appender
        return appender

    def _check(self, keyed: Keyed) -> str | None:
        n, width = keyed.tokens.shape
        if keyed.lane not in self.lanes or width > keyed.lane:
            return f"lane {keyed.lane} (width {width}) is not a configured lane"
        if (
            len(keyed.index) != n
            or len(keyed.lengths) != n
            or (n and int(keyed.lengths.max()) > width)
        ):
            return "record arrays disagree in length"
        return None

    def step(self, now: float) -> None:
        if self._backlog():
            self.idle.busy()
        elif self.syncer.in_flight is not None:  # wait for records, or the disk's answer
            self.idle.busy()
            self._wait(self.poll_ms)
        else:  # idle: wait for records
            self._wait(self.idle.wait_ms(now))
        self.wakeups.drain(0)  # the rings hold the work
        self._collect(now, wait=False)  # answers go out as soon as the disk gave them
        batch = StepAppends()
        if self._take(now, batch):
            self._gather(now, batch)
        if self.syncer.in_flight is not None and (batch or self._dirty()):
            self._collect(now, wait=True)  # one sync in flight, in order
        if self.syncer.in_flight is None:
            if self._dirty():
                self._submit(batch)
            elif batch:  # every record refused or dropped: nothing to sync
                self._answer(batch, None, now)
            elif self.disk.full and self.disk.ready(now):
                self._probe_disk(now)
        self.disk.settle(now)
        for appender in self.appenders.values():
            appender.maybe_rotate(now)  # a seal is synced with the next hand-off
        if round(now * 1e9) > self.tries_due_ns:  # a try past its deadline appends no more
            now_ns = round(now * 1e9)
            self.tries = {key: seen for key, seen in self.tries.items() if key[2] >= now_ns}
            self.tries_due_ns = min((key[2] for key in self.tries), default=NEVER_NS)

    def _wait(self, wait_ms: int) -> tuple[bool, bool]:
        """Wait up to `wait_ms` for a wakeup or the in-flight sync; (woken, sync back)."""
        ready = dict(self.poller.poll(wait_ms))
        return self.wakeups.socket in ready, self.syncer.fd in ready

    def _gather(self, now: float, batch: StepAppends) -> None:
        """The group-commit window: take what arrives until the last step's sync is back (then
        its chunks are answered and this batch handed over at once, so a producer's window
        is not held up by a long batch), or, with none in flight, for `writers.flush_ms`."""
        taken = 0
        if self.syncer.in_flight is not None:
            while taken < MAX_RECORDS_PER_STEP:
                if self._backlog():
                    if self.syncer.back():
                        return
                else:
                    woken, back = self._wait(self.poll_ms)
                    if back or not woken:
                        return
                    self.wakeups.drain(0)
                taken += self._take(now, batch)
        elif self.flush_s > 0:
            deadline = time.monotonic() + self.flush_s
            while taken < MAX_RECORDS_PER_STEP:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self.wakeups.drain(left_ms, most=1):
                    return
                taken += self._take(now, batch)

    def _dirty(self) -> bool:
        return any(appender.dirty for appender in self.appenders.values())

    def _submit(self, batch: StepAppends) -> None:
        """Hand every segment written or sealed since the last hand-off to the sync thread."""
        segments: list[Segment] = []
        for appender in self.appenders.values():
            if appender.dirty:
                handed = appender.begin_sync()
                batch.syncs.append((appender, handed))
                segments.extend(segment for segment, _ in handed)
        self.syncer.submit(Ticket(segments, batch))

    def _collect(self, now: float, wait: bool) -> None:
        """Take the in-flight sync back if it is (waiting for it if `wait`), and answer its
        step's chunks: acknowledged if every fdatasync returned, refused if one failed."""
        ticket = self.syncer.collect(None if wait else 0)
        if ticket is None:
            return
        batch: StepAppends = ticket.payload  # type: ignore[assignment]
        for appender, handed in batch.syncs:
            appender.end_sync(handed, ok=ticket.error is None)
        if ticket.error is not None and not isinstance(ticket.error, DiskFullError):
            raise ticket.error  # an I/O error: the stage exits and its supervisor restarts it
        if ticket.error is None:
            self.fsync_s.observe(ticket.seconds)
        self._answer(batch, ticket.error, now)

    def _answer(self, batch: StepAppends, error: BaseException | None, now: float) -> None:
        failed = batch.failed
        if error is not None:  # not durable: no chunk of this step is acknowledged
            self.disk.failed(error, now)
            failed.update({chunk: str(error) for chunk in batch.durable if chunk not in failed})
            # dispatch finds what did reach the disk by its rescan
        elif batch.syncs:
            self.disk.succeeded(now)
            self._announce(batch.placed)
        for (job_no, chunk), count in batch.durable.items():
            if (job_no, chunk) not in failed:
                self._tell(
                    wire.MessageType.APPEND_ACK,
                    {"job_no": job_no, "chunk": chunk, "count": count},
                    arrays={"index": np.concatenate(batch.index[(job_no, chunk)])},
                )
                self.appended += count
        for (job_no, chunk), reason in failed.items():
            self._tell(
                wire.MessageType.ERROR,
                {"reason": reason, "job_no": job_no, "chunk": chunk},
                wire.Flag.RETRYABLE,
            )

    def _probe_disk(self, now: float) -> None:
        """With nothing to append while the disk is full, try it: sync what a failed sync left
        (a seal, pages), then write a probe page. A retried chunk whose items were placed by
        an earlier try is not appended again, so without this the episode might never end."""
        try:
            for appender in self.appenders.values():
                appender.sync()
            probe(self.data_dir.segments, self.label)
        except DiskFullError as exc:
            self.disk.failed(exc, now)
        else:
            self.disk.succeeded(now)

    def _take(self, now: float, batch: StepAppends) -> int:
        """Append every waiting record (up to the step's limit); returns how many were taken.

        Rings are released as soon as their records are appended: the slots are
        copied out by then, and nothing is acknowledged before the sync.
        """
        taken = 0
        for port in self.ports:
            ring = port.get(now)
            if ring is None:
                continue
            while taken < MAX_RECORDS_PER_STEP:
                record = ring.get()
                if record is None:
                    break
                taken += 1
                self._append(port.name, *record, now, batch)
            ring.release()
        return taken

    def _append(self, ring: str, kind: int, payload, now: float, batch: StepAppends) -> None:
        if kind != KEYED:
            self.log.error("ring %s: unexpected record kind %d; dropped", ring, kind)
            return
        keyed = read_keyed(payload)
        chunk = (keyed.job_no, keyed.chunk)
        problem = self._check(keyed)
        if problem is not None:
            self.log.error(
                "ring %s: bad record for job %d chunk %d: %s; dropped", ring, *chunk, problem
            )
            return
        if keyed.deadline_ns < round(now * 1e9):  # `now` is CLOCK_MONOTONIC, like deadline_ns
            self.log.warning("job %d chunk %d: past its deadline; dropped unappended", *chunk)
            return
        if chunk in batch.failed:
            return
        fresh = self._not_yet_appended(keyed)
        if fresh is None:
            return
        keyed = fresh
        try:
            placed = self._appender((keyed.model, keyed.shape, keyed.lane)).append(
                seq_of(keyed.job_no, keyed.index),
                np.full(len(keyed.index), keyed.job_no, np.uint64),
                keyed.index,
                keyed.lengths,
                keyed.tokens,
            )
            batch.durable[chunk] += len(keyed.index)
            batch.index[chunk].append(np.array(keyed.index))  # a copy: the ring is released
            try_key = (keyed.job_no, keyed.chunk, keyed.deadline_ns)
            seen = self.tries.get(try_key)
            self.tries_due_ns = min(self.tries_due_ns, keyed.deadline_ns)
            self.tries[try_key] = (
                np.sort(keyed.index) if seen is None else np.union1d(seen, keyed.index)
            )
            self.appended_by_key[(keyed.model, str(keyed.lane))] += len(keyed.index)
            for segment_id, first, count in placed.tolist():
                batch.placed[segment_id] = max(batch.placed.get(segment_id, 0), first + count)
            self.disk.succeeded(now)
        except DiskFullError as exc:  # the front tells the producer, who sends it again
            batch.failed[chunk] = str(exc)
            self.disk.failed(exc, now)
            self.disk.refused()

    def _not_yet_appended(self, keyed: Keyed) -> Keyed | None:
        """The record less the items this life already appended for the same try of its
        chunk (same job, chunk and deadline: a record delivered twice, by a ring read again
        or routed again); None when none is left. Appended twice, the items would be
        acknowledged twice and the chunk's commit would count them twice."""
        seen = self.tries.get((keyed.job_no, keyed.chunk, keyed.deadline_ns))
        if seen is None:
            return keyed
        fresh = ~np.isin(keyed.index, seen, assume_unique=True)
        if fresh.all():
            return keyed
        self.log.warning(
            "job %d chunk %d: %d item(s) came again after this writer appended them; appended once",
            keyed.job_no,
            keyed.chunk,
            int((~fresh).sum()),
        )
        if not fresh.any():
            return None
        return Keyed(
            keyed.job_no,
            keyed.chunk,
            keyed.deadline_ns,
            keyed.model,
            keyed.shape,
            keyed.lane,
            keyed.index[fresh],
            keyed.lengths[fresh],
            keyed.tokens[fresh],
        )

    def _announce(self, placed: dict[int, int]) -> None:
        """Tell dispatch what is durable now; a lost notice is found by its rescan."""
        for segment_id, end in placed.items():
            try:
                wire.send(
                    self.dispatch, wire.MessageType.APPENDED, {"segment": segment_id, "end": end}
                )
            except FabricError:
                break

    def stats(self, now: float) -> dict:
        """Items appended per (model, lane) and group-commit latency (docs/metrics.md)."""
        return {
            "fabric_items_appended_total": dict(self.appended_by_key),
            "fabric_writer_items_appended_total": {
                (str(self.index),): sum(self.appended_by_key.values())
            },
            "fabric_writer_fsync_seconds": self.fsync_s,
            **self.disk.figures(self.label),
        }

    def _backlog(self) -> bool:
        """True while any input ring holds records."""
        return any(p.ring is not None and p.ring.used_bytes for p in self.ports)

    def _tell(self, msg_type, meta, flags=0, arrays=None) -> None:
        try:
            wire.send(self.acks, msg_type, meta, arrays, flags=flags)
        except FabricError as exc:  # the front restarting: the chunk times out and is retried
            self.log.warning(
                "could not tell the front about job %s chunk %s: %s",
                meta["job_no"],
                meta["chunk"],
                exc,
            )

    def drain(self, deadline: float) -> None:
        self.idle.busy()  # short idle waits: a step that appends nothing ends the drain
        while time.monotonic() < deadline:
            before = self.appended
            self.step(time.monotonic())
            if self.appended == before and not self._backlog() and self.syncer.in_flight is None:
                break

    def close(self) -> None:
        self._collect(time.monotonic(), wait=True)  # answer the last step before going
        self.syncer.close()
        for appender in self.appenders.values():
            try:
                appender.close()
            except DiskFullError as exc:  # a seal not durable: recovery seals it anyway
                self.log.error("closing %s: %s", appender.key, exc)
        for port in self.ports:
            port.close()
        self.wakeups.socket.close(0)
        self.acks.close()
        self.dispatch.close(0)
        self.context.term()
        self.log.info("writer closed: %d items appended in this life", self.appended)
