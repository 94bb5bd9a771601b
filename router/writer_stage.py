"""The segment writer stage: append what the routers send, group-commit, acknowledge.

Each writer owns the keys (model, shape, lane) that hash to it, one
SegmentAppender per key. A step takes every KEYED record waiting in its
rings, appends them, syncs every segment it touched (one fdatasync each:
group commit), releases the rings, and only then tells the front how many
items of which chunk are durable (APPEND_ACK). A record whose deadline has
passed is dropped unappended: the front has given up on that chunk and its
producer will retry it. A full disk answers the chunk with a retryable error
(nothing of a failed append is stored, and a failed group commit fails every
chunk of the step), logged once, not once per chunk (pipeline/disk_full.py);
the writer goes on and the next append tries the disk again; with nothing to
append it probes the disk once a second, so "disk writable again" is said
once space is freed whether or not more work comes.

Stage logic takes its clock from `step(now)` (CLOCK_MONOTONIC seconds): a
record's deadline and the full-disk episode are judged on it, so a test can
drive a writer on a clock of its own. Two things use real time on purpose:
the group-commit window (`writers.flush_ms`, a real wait for more records;
records it takes are judged on the step's `now`) and the fsync latency it
measures.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np
import zmq

from pipeline import wire
from pipeline.datadir import DataDir
from pipeline.disk_full import FullDisk, probe
from pipeline.errors import DiskFullError, FabricError
from pipeline.item_seq import seq_of
from pipeline.metrics import FSYNC_BUCKETS_S, Histogram
from pipeline.ring_port import RingPort
from pipeline.ring_records import KEYED, Keyed, read_keyed
from pipeline.segment_append import SegmentAppender, SegmentIds
from pipeline.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.stage import Stage
from pipeline.topology import internal_address, rings_to

MAX_RECORDS_PER_STEP = 256


class WriterStage(Stage):
    name = "writer"
    poll_ms = 50

    def open(self) -> None:
        settings = self.settings
        self.data_dir = DataDir(settings.data_path).ensure()
        self.ids = SegmentIds(self.data_dir)
        self.lanes = frozenset(settings.broker.lanes)
        self.appenders: dict[tuple[str, int, int], SegmentAppender] = {}
        self.ports = [RingPort(r.name) for r in rings_to(settings, f"writer-{self.index}")]
        self.context = zmq.Context()
        wakeups = wire.open_socket(
            self.context, zmq.PULL, bind=internal_address(settings, f"writer-{self.index}")
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
        self.placed: dict[int, int] = {}  # segment id -> end of what this step appended
        self.appended = 0
        self.flush_s = settings.writers.flush_ms / 1000
        self.appended_by_key: Counter = Counter()  # (model, lane) -> items appended (metrics)
        self.fsync_s = Histogram(FSYNC_BUCKETS_S)  # one group commit per observation
        self.disk = FullDisk(self.log, "chunks that need new space are refused, retryably")

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
        self.wakeups.drain(0 if self._backlog() else self.poll_ms)  # the rings hold the work
        durable: dict[tuple[int, int], int] = defaultdict(int)
        failed: dict[tuple[int, int], str] = {}
        taken = self._take(now, durable, failed)
        if taken and self.flush_s > 0:  # the group-commit window: let more arrive first
            deadline = time.monotonic() + self.flush_s
            while taken < MAX_RECORDS_PER_STEP:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self.wakeups.drain(left_ms, most=1):
                    break
                taken += self._take(now, durable, failed)
        if durable:
            began = time.perf_counter()
            try:
                for appender in self.appenders.values():
                    appender.sync()
            except DiskFullError as exc:  # not durable: no chunk of this step is acknowledged
                self.disk.failed(exc, now)
                failed.update({chunk: str(exc) for chunk in durable if chunk not in failed})
                self.placed.clear()  # dispatch finds what did reach the disk by its rescan
            else:
                self.fsync_s.observe(time.perf_counter() - began)
                self.disk.succeeded(now)
                self._announce()
        elif self.disk.full and self.disk.ready(now):
            self._probe_disk(now)
        for (job_no, chunk), count in durable.items():
            if (job_no, chunk) not in failed:
                self._tell(
                    wire.MessageType.APPEND_ACK, {"job_no": job_no, "chunk": chunk, "count": count}
                )
                self.appended += count
        for (job_no, chunk), reason in failed.items():
            self._tell(
                wire.MessageType.ERROR,
                {"reason": reason, "job_no": job_no, "chunk": chunk},
                wire.Flag.RETRYABLE,
            )
        self.disk.settle(now)
        for appender in self.appenders.values():
            if appender.maybe_rotate(now):
                try:
                    appender.sync()
                except DiskFullError as exc:  # the seal is written again at the next sync
                    self.disk.failed(exc, now)

    def _probe_disk(self, now: float) -> None:
        """With nothing to append while the disk is full, try it: sync what a failed sync left
        (a seal, pages), then write a probe page. A retried chunk whose items were placed by
        an earlier try is not appended again, so without this the episode might never end."""
        try:
            for appender in self.appenders.values():
                appender.sync()
            probe(self.data_dir.segments, f"writer-{self.index}")
        except DiskFullError as exc:
            self.disk.failed(exc, now)
        else:
            self.disk.succeeded(now)

    def _take(self, now: float, durable: dict, failed: dict) -> int:
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
                self._append(port.name, *record, now, durable, failed)
            ring.release()
        return taken

    def _append(
        self, ring: str, kind: int, payload, now: float, durable: dict, failed: dict
    ) -> None:
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
        if chunk in failed:
            return
        try:
            placed = self._appender((keyed.model, keyed.shape, keyed.lane)).append(
                seq_of(keyed.job_no, keyed.index),
                np.full(len(keyed.index), keyed.job_no, np.uint64),
                keyed.index,
                keyed.lengths,
                keyed.tokens,
            )
            durable[chunk] += len(keyed.index)
            self.appended_by_key[(keyed.model, str(keyed.lane))] += len(keyed.index)
            for segment_id, first, count in placed.tolist():
                self.placed[segment_id] = max(self.placed.get(segment_id, 0), first + count)
            self.disk.succeeded(now)
        except DiskFullError as exc:  # the front tells the producer, who sends it again
            failed[chunk] = str(exc)
            self.disk.failed(exc, now)
            self.disk.refused()

    def _announce(self) -> None:
        """Tell dispatch what is durable now; a lost notice is found by its rescan."""
        for segment_id, end in self.placed.items():
            try:
                wire.send(
                    self.dispatch, wire.MessageType.APPENDED, {"segment": segment_id, "end": end}
                )
            except FabricError:
                break
        self.placed.clear()

    def stats(self, now: float) -> dict:
        """Items appended per (model, lane) and group-commit latency (docs/metrics.md)."""
        return {
            "fabric_items_appended_total": dict(self.appended_by_key),
            "fabric_writer_items_appended_total": {
                (str(self.index),): sum(self.appended_by_key.values())
            },
            "fabric_writer_fsync_seconds": self.fsync_s,
        }

    def _backlog(self) -> bool:
        """True while any input ring holds records."""
        return any(p.ring is not None and p.ring.used_bytes for p in self.ports)

    def _tell(self, msg_type, meta, flags=0) -> None:
        try:
            wire.send(self.acks, msg_type, meta, flags=flags)
        except FabricError as exc:  # the front restarting: the chunk times out and is retried
            self.log.warning(
                "could not tell the front about job %s chunk %s: %s",
                meta["job_no"],
                meta["chunk"],
                exc,
            )

    def drain(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            before = self.appended
            self.step(time.monotonic())
            if self.appended == before and not self._backlog():
                break

    def close(self) -> None:
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
