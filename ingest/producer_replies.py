"""The answers the front owes producers in one step, held until that step's journal sync.

A step decides its answers as it goes (CATALOG, JOB_INFO, CHUNK_ACK, CHUNK_ERROR,
ERROR) and queues them here; they go out only after the step's group commit of
the job journals, so no CHUNK_ACK leaves before the `commit` it reports is
durable. When that sync fails, every fresh CHUNK_ACK queued in the step turns
into a retryable CHUNK_ERROR (a duplicate's ack reports a commit already on
disk and stays). A producer that is gone costs a log line, never the stage.

| queued                       | sent as                                        |
|------------------------------|------------------------------------------------|
| `add(route, type, meta, ..)` | that message                                   |
| `refuse(route, meta, why)`   | CHUNK_ERROR, not retryable (the chunk is bad)  |
| `retry(route, job, n, why)`  | CHUNK_ERROR, RETRYABLE (send it again later)   |
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from ingest import front_answers
from pipeline.core.errors import WireError
from pipeline.transport import wire

MT = wire.MessageType
Reply = tuple[tuple[bytes, ...], MT, dict[str, Any], int, Any]  # route, type, meta, flags, arrays


class ProducerReplies:
    """One step's answers to producers, in the order the step decided them."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.queued: list[Reply] = []

    def add(
        self, route, msg_type: MT, meta: dict[str, Any], flags: int = 0, arrays: dict | None = None
    ) -> None:
        self.queued.append((route, msg_type, meta, flags, arrays))

    def refuse(self, route: tuple[bytes, ...], meta: dict[str, Any], reason: str) -> None:
        """A CHUNK_ERROR that is not retryable: the chunk itself is bad."""
        self.log.warning("refused a chunk: %s", reason)
        self.add(route, MT.CHUNK_ERROR, front_answers.chunk_error(meta, reason))

    def retry(self, route, job_id: str, number: int, reason: str) -> None:
        """A retryable CHUNK_ERROR: the producer sends the chunk again later."""
        meta = front_answers.chunk_error({"job": job_id, "chunk": number}, reason)
        self.add(route, MT.CHUNK_ERROR, meta, wire.Flag.RETRYABLE)

    def journal_failed(self, exc: Exception) -> None:
        """The step's journal sync failed: its fresh CHUNK_ACKs become retryable errors."""
        self.queued = [
            (
                route,
                MT.CHUNK_ERROR,
                {"job": m["job"], "chunk": m["chunk"], "reason": str(exc)},
                wire.Flag.RETRYABLE,
                None,
            )
            if t == MT.CHUNK_ACK and not m.get("duplicate")
            else (route, t, m, f, a)
            for route, t, m, f, a in self.queued
        ]

    def send(self, producers: zmq.Socket) -> None:
        """Send every queued answer on the producers' ROUTER; a gone producer is skipped."""
        for route, msg_type, meta, flags, arrays in self.queued:
            try:
                wire.send(producers, msg_type, meta, arrays, route=route, flags=flags)
            except WireError as exc:
                self.log.info("could not answer a producer (gone?): %s", exc)
        self.queued = []
