"""The tokenizer stage: text prompts become tokens with each model's own tokenizer.

The front sends a chunk that has text items (TOKENIZE, the chunk as in
ingest.chunk_wire plus its job number and deadline). A tokenizer runs
`tokenize_chunk` (over-long and empty prompts become error records), writes
every remaining item into its ring to the chunk's router as one ITEMS
record, and reports to the front how many items it forwarded and which
lines it rejected (TOKENIZED). Each of the `[ingest] processes` tokenizers
encodes on its share of the cores (`share_cores`, ingest/tokenize.py). It
waits for room when the ring is full, so a slow router pushes back on the
front: the chunk waits in the stage (`waiting`), tried again at each
`step(now)` and reading no new chunk meanwhile, until it is in the ring or
`now` passes its deadline (then the front is told it failed). The stage
reads no clock, so tests step it on a fake one (tests/test_tokenizer_stage.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import zmq

from config.stage_settings import TokenizerStageSettings
from ingest.chunk_items import items_of, router_for
from ingest.chunk_wire import chunk_from_wire
from ingest.error_wire import errors_to_wire
from ingest.tokenize import load_tokenizers, share_cores, tokenize_chunk
from pipeline.core.errors import FabricError
from pipeline.process.stage import Stage
from pipeline.transport import wire
from pipeline.transport.outlet import Outlet
from pipeline.transport.ring_records import Items, put_items, split_items
from pipeline.transport.topology import internal_address

ROOM_WAIT_MS = 5  # a step waiting for room in a full ring waits this long for the router


@dataclass
class Waiting:
    """A tokenized chunk whose pieces are not all in its router's ring yet."""

    job_no: int
    chunk: int
    router: int
    pieces: deque[Items]
    deadline_s: float  # on the stage's `now` (CLOCK_MONOTONIC, like the chunk's deadline_ns)
    errors: list
    forwarded: int


class TokenizerStage(Stage[TokenizerStageSettings]):
    name = "tokenizer"
    poller: zmq.Poller  # made by open()
    poll_ms = 100

    def open(self) -> None:
        settings = self.settings
        threads = share_cores(settings.ingest.processes)  # before the library's pool starts
        self.log.info("encoding on %d thread(s)", threads)
        self.tokenizers = load_tokenizers(settings)
        self.context = zmq.Context()
        inbox = wire.open_socket(
            self.context, zmq.PULL, recv_hwm=4, connect=internal_address(settings, "tokenize")
        )
        self.inbox = wire.Inbox(inbox, self.log, "the front")
        self.poller = zmq.Poller()  # the wait for a chunk (run_stage adds its signal wake)
        self.poller.register(inbox, zmq.POLLIN)
        self.report = wire.open_socket(
            self.context,
            zmq.PUSH,
            linger_ms=1000,
            send_timeout_ms=1000,
            connect=internal_address(settings, "front"),
        )
        self.outlet = Outlet(self.context, settings, self.label, "router")
        self.waiting: Waiting | None = None
        self.done = 0

    def step(self, now: float) -> None:
        if self.waiting is not None:
            self._forward(now)
            if self.waiting is not None:  # the ring is still full: wait a little for the router
                zmq.Poller().poll(ROOM_WAIT_MS)
            return
        if not self.poller.poll(self.poll_ms):
            return
        for message in self.inbox.read(1):
            self._tokenize(message, now)

    def _tokenize(self, message: wire.Message, now: float) -> None:
        meta = message.meta
        job_no, deadline_ns = int(meta["job_no"]), int(meta["deadline_ns"])
        try:
            chunk = chunk_from_wire(meta, message.arrays)
            tokenized = tokenize_chunk(chunk, self.tokenizers, self.settings)
        except FabricError as exc:
            self._report(job_no, int(meta["index"]), error=str(exc))
            return
        known = set(chunk.errors)
        items = items_of(tokenized, job_no, deadline_ns) if tokenized.n_items else None
        self.waiting = Waiting(
            job_no,
            chunk.index,
            router_for(chunk.index, len(self.outlet)),
            deque(split_items(items)) if items is not None else deque(),
            deadline_s=max(now, deadline_ns / 1e9),  # `now` is CLOCK_MONOTONIC, like deadline_ns
            errors=[e for e in tokenized.errors if e not in known],
            forwarded=tokenized.n_items,
        )
        self._forward(now)

    def _forward(self, now: float) -> None:
        """Put the waiting chunk's pieces into its router's ring; report it once they are all
        there, or failed once `now` passed its deadline first."""
        waiting = self.waiting
        if waiting is None:
            return
        while waiting.pieces and self.outlet.try_put(waiting.router, put_items, waiting.pieces[0]):
            waiting.pieces.popleft()
        if waiting.pieces and now <= waiting.deadline_s:
            return
        self.waiting = None
        if waiting.pieces:
            error = "the router did not take the chunk before its deadline"
            self._report(waiting.job_no, waiting.chunk, error=error)
            return
        self._report(
            waiting.job_no, waiting.chunk, forwarded=waiting.forwarded, errors=waiting.errors
        )
        self.done += 1

    def _report(
        self, job_no: int, chunk: int, *, forwarded: int = 0, errors=(), error: str | None = None
    ) -> None:
        meta = {"job_no": job_no, "chunk": chunk, "forwarded": forwarded, "errors": []}
        if error is not None:
            meta["failed"] = error
            self.log.error("job %d chunk %d: %s", job_no, chunk, error)
        try:
            # the rejected lines as arrays: a list in the meta would outgrow its 1 MiB limit
            wire.send(self.report, wire.MessageType.TOKENIZED, meta, errors_to_wire(errors))
        except FabricError as exc:
            self.log.warning(
                "could not report job %d chunk %d to the front: %s", job_no, chunk, exc
            )

    def close(self) -> None:
        self.outlet.close()
        self.inbox.socket.close(0)
        self.report.close()
        self.context.term()
