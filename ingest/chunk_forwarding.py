"""Sending accepted chunks on from the front, in the order they were accepted.

| chunk                      | goes to                          | as                                  |
|----------------------------|----------------------------------|-------------------------------------|
| some prompts are text      | a tokenizer (`tokenize` PUSH)    | TOKENIZE (ingest/chunk_wire.py)     |
| every prompt is tokens     | its router's ring (`router_for`) | ITEMS records (ingest/chunk_items.py) |
| no items (all lines bad)   | nowhere                          | expects 0 reports                   |

A chunk that does not fit yet (tokenizers busy or none up, a ring full) stays
at the head of the queue and is tried again next step; the chunks behind it
wait with it, and the front takes no new chunk while any wait. A chunk whose
pieces went partly into a ring resumes at its next piece.
"""

from __future__ import annotations

from collections import deque

import zmq

from ingest.chunk_items import items_of, router_for
from ingest.chunk_wire import chunk_to_wire
from ingest.inflight import Inflight, InflightChunks
from pipeline.core.errors import WireError
from pipeline.transport import wire
from pipeline.transport.outlet import Outlet
from pipeline.transport.ring_records import put_items, split_items

MT = wire.MessageType


class ChunkForwarding:
    """The accepted chunks not yet sent on whole, oldest first."""

    def __init__(self, tokenize: zmq.Socket, outlet: Outlet, inflight: InflightChunks) -> None:
        self.tokenize = tokenize  # the front's PUSH to the tokenizers
        self.outlet = outlet  # the front's rings to the routers
        self.inflight = inflight
        self.unsent: deque[Inflight] = deque()

    @property
    def waiting(self) -> bool:
        """Whether some chunk still waits for room in a ring or a tokenizer."""
        return bool(self.unsent)

    def queue(self, flight: Inflight) -> None:
        self.unsent.append(flight)

    def send_on(self) -> None:
        """Send what fits now, oldest first; stop at the first chunk that does not."""
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
        router = router_for(to_send.index, len(self.outlet))
        while flight.pieces:
            if not self.outlet.try_put(router, put_items, flight.pieces[0]):
                return False
            flight.pieces.popleft()
        return True
