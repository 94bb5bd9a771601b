"""The chunks the front works on: each one's progress, and the caps on what producers may hold.

A chunk is in flight from the moment the front accepts it until it answers
CHUNK_ACK or CHUNK_ERROR. What producers can make the front hold is capped
(docs/wire.md, "Limits on each port"): chunks in flight by count and by
bytes, per producer connection (`route`) and in all. A chunk past a cap is
refused retryably; a connection holding nothing may always send one chunk,
so a chunk larger than a byte cap is never refused for ever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingest.input_chunk import InputChunk, fanout_record
from ingest.jobs import Job
from ingest.line_errors import LineError
from ingest.model_aliases import WrittenNames
from ingest.reuse_keys import ReuseFound

DEADLINE_MARGIN_S = 5.0  # the front waits this much past the writers' deadline


@dataclass
class Inflight:
    job: Job
    chunk: InputChunk
    final: bool
    route: tuple[bytes, ...]
    deadline_s: float  # the front gives up on the chunk after this (monotonic seconds)
    deadline_ns: int  # writers drop its records after this (CLOCK_MONOTONIC ns)
    expected: int | None  # items sent on; None until a tokenizer reports
    already: list[tuple[int, str]] = field(default_factory=list)  # (line, custom_id) stored before
    acked: int = 0  # distinct items the writers acknowledged (acked_index's length)
    acked_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    errors: list[LineError] = field(default_factory=list)
    sent: bool = False
    pieces: deque | None = None  # records still to put into the router's ring
    digests: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    nbytes: int = 0  # the chunk's arrays as received, for ingest.*inflight_bytes
    written: WrittenNames | None = None  # the aliases its lines gave (ingest/model_aliases.py)
    reuse: ReuseFound | None = None  # a reusing job's lines found in the index, and keys

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.job_no, self.chunk.index)

    def count_acked(self, index: np.ndarray | None, count: int) -> None:
        """A writer's APPEND_ACK: `index` the items it made durable. Each item counts once,
        however often it is acknowledged (its records delivered twice: docs/ingest.md,
        "Exactly once into the log"); an answer that names no items counts `count`."""
        if index is None:
            self.acked += count
            return
        self.acked_index = np.union1d(self.acked_index, index.astype(np.uint32, copy=False))
        self.acked = len(self.acked_index)

    @property
    def complete(self) -> bool:
        return self.sent and self.expected is not None and self.acked >= self.expected

    def commit_record(self) -> dict[str, Any]:
        """What `Job.commit` records for the chunk: its stored lines and custom_ids in line
        order (those an earlier attempt stored included), the count, every bad line, and the
        aliases its stored lines gave."""
        chunk = self.chunk
        errors = sorted([*chunk.errors, *self.errors], key=lambda e: e.line)
        rejected = {e.line for e in self.errors}
        if rejected or self.already:
            pairs = [
                (int(line), custom_id)
                for line, custom_id in zip(chunk.line.tolist(), chunk.custom_ids, strict=True)
                if line not in rejected
            ]
            pairs = sorted(pairs + self.already)
            lines, ids = [line for line, _ in pairs], [custom_id for _, custom_id in pairs]
        else:  # the usual case: every item forwarded was stored, already in line order
            lines, ids = chunk.line.tolist(), list(chunk.custom_ids)
        record = {
            "lines": lines,
            "ids": ids,
            "stored": self.acked + len(self.already),
            "errors": error_list(errors),
            "final": self.final,
            "digests": self.digests if not (rejected or self.already) else None,
        }
        if chunk.fanout:  # a line's parts are items of one line: one entry per line
            pairs = sorted(dict(zip(lines, ids, strict=True)).items())
            record["lines"], record["ids"] = [a for a, _ in pairs], [b for _, b in pairs]
            record["stored"] = len(pairs)
            stored = set(record["lines"])
            parts = [fanout_record(f) for f in chunk.fanout if f[0] in stored]
            if parts:
                record["parts"] = parts
        if self.written is not None:
            record.update(self.written.record(record["lines"]))
        if self.reuse is not None and (reuse := self.reuse.record()):
            record["reuse"] = reuse
        return record


def error_list(errors: list[LineError]) -> list[list[Any]]:
    return [[e.line, e.custom_id, e.code, e.message] for e in errors]


class InflightChunks:
    """The chunks in flight, by (job_no, chunk index), and the caps on them."""

    def __init__(
        self, max_chunks: int, producer_chunks: int, max_bytes: int, producer_bytes: int
    ) -> None:
        self.max_chunks = max_chunks  # ingest.max_chunks_in_flight
        self.producer_chunks = producer_chunks  # ingest.producer_chunks_in_flight
        self.max_bytes = max_bytes  # ingest.max_inflight_bytes
        self.producer_bytes = producer_bytes  # ingest.producer_inflight_bytes
        self.by_key: dict[tuple[int, int], Inflight] = {}

    @classmethod
    def from_settings(cls, ingest) -> InflightChunks:
        """The caps of the `[ingest]` settings."""
        return cls(
            ingest.max_chunks_in_flight,
            ingest.producer_chunks_in_flight,
            ingest.max_inflight_bytes,
            ingest.producer_inflight_bytes,
        )

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.by_key

    def __iter__(self):
        return iter(list(self.by_key.values()))

    def get(self, key: tuple[int, int]) -> Inflight | None:
        return self.by_key.get(key)

    def add(self, flight: Inflight) -> None:
        self.by_key[flight.key] = flight

    def remove(self, flight: Inflight) -> None:
        self.by_key.pop(flight.key, None)

    @property
    def full(self) -> bool:
        return len(self.by_key) >= self.max_chunks

    def busy(self, route: tuple[bytes, ...], nbytes: int) -> str | None:
        """Why a new chunk of `nbytes` from `route` must wait (retryably), or None."""
        mine = [f for f in self.by_key.values() if f.route == route]
        if len(mine) >= self.producer_chunks:
            return (
                f"this producer already has {self.producer_chunks} chunks in flight "
                "(ingest.producer_chunks_in_flight); send it again when one is answered"
            )
        held = sum(f.nbytes for f in mine)
        total = sum(f.nbytes for f in self.by_key.values())
        if held and held + nbytes > self.producer_bytes:
            return (
                f"this producer already has {held} bytes of chunks in flight "
                f"(ingest.producer_inflight_bytes = {self.producer_bytes}); "
                "send it again when one is answered"
            )
        if total and total + nbytes > self.max_bytes:
            return (
                f"the front holds {total} bytes of chunks in flight "
                f"(ingest.max_inflight_bytes = {self.max_bytes}); send it again later"
            )
        return None

    def expired(self, now: float) -> list[Inflight]:
        return [f for f in self.by_key.values() if now > f.deadline_s]

    def complete(self) -> list[Inflight]:
        return [f for f in self.by_key.values() if f.complete]

    def digests_of_job(self, job: Job, but_chunk: int) -> list[np.ndarray]:
        """The custom_id digests of the job's other chunks in flight (for the repeat check)."""
        return [
            f.digests[0]
            for f in self.by_key.values()
            if f.job is job and f.chunk.index != but_chunk
        ]

    def job_numbers(self) -> set[int]:
        return {f.job.job_no for f in self.by_key.values()}
