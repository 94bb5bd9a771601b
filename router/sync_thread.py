"""A segment writer's sync thread: one step's fdatasyncs run while the writer appends the next.

The writer (router/writer_stage.py) appends a step's records, hands the segments
it wrote to this thread as a `Ticket`, and goes on appending the next step's
records while the disk syncs; it answers the ticket's chunks only once the ticket
is back (`collect`), so nothing is acknowledged before the fdatasync of every
segment its items went to.

Ownership (one owner per piece of mutable state):

| state                                   | owner                                        |
|-----------------------------------------|----------------------------------------------|
| SegmentAppenders, Segments (maps, counts, `_dirty`, staging buffers) | the writer's thread |
| a submitted Ticket                      | this thread, from `submit` until `collect` returns it |
| the file descriptor of a Segment in a submitted Ticket | both: this thread only calls `Segment.fdatasync` on it; the writer may pwrite to it and store markers through its mapping, but must not close it until the ticket is back |

One ticket is in flight at a time: the writer collects the last one before it
submits the next, so syncs complete in the order their appends were made, and an
fdatasync covers every write that returned before it was called (the writer's
later appends may or may not be in it; they are synced again by their own
ticket). A failed fdatasync ends the ticket with `error` set (DiskFullError for a
full disk, anything else is re-raised by the writer) and the writer fails exactly
that ticket's chunks. `fd` becomes readable when a ticket is back, so the writer
can wait for either new records or the disk (zmq.Poller) in one call.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

from pipeline.store.segment import Segment


@dataclass
class Ticket:
    """Segments to fdatasync, and what the writer answers once they are (opaque here)."""

    segments: list[Segment]
    payload: object = None
    error: BaseException | None = None  # set by the sync thread if an fdatasync failed
    seconds: float = 0.0  # how long the fdatasyncs took


class SyncThread:
    """One blocking I/O thread that fdatasyncs the segments of a ticket, one ticket at a time."""

    def __init__(self, name: str) -> None:
        # queue.Queue waits in Condition.wait, which profiles (bench/ingest_profile.py) count
        # as waiting, not working
        self._todo: queue.Queue[Ticket | None] = queue.Queue()
        self._done: queue.Queue[Ticket] = queue.Queue()
        self._back_r, self._back_w = os.pipe()  # one byte per ticket back
        self.in_flight: Ticket | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def fd(self) -> int:
        """Readable while a ticket is back and not yet collected."""
        return self._back_r

    def submit(self, ticket: Ticket) -> None:
        if self.in_flight is not None:
            raise RuntimeError("a sync is already in flight: collect it before submitting")
        self.in_flight = ticket
        self._todo.put(ticket)

    def back(self) -> bool:
        """True when the ticket in flight is back, ready to collect without waiting."""
        return self.in_flight is not None and not self._done.empty()

    def collect(self, timeout: float | None) -> Ticket | None:
        """The in-flight ticket once its fdatasyncs returned, waiting at most `timeout` seconds
        (None: until it is back); None if none is in flight or it is still syncing."""
        if self.in_flight is None:
            return None
        try:
            ticket = self._done.get(timeout=timeout) if timeout != 0 else self._done.get_nowait()
        except queue.Empty:
            return None
        os.read(self._back_r, 1)
        self.in_flight = None
        return ticket

    def _run(self) -> None:
        while True:
            ticket = self._todo.get()
            if ticket is None:
                return
            began = time.perf_counter()
            try:
                for segment in ticket.segments:
                    segment.fdatasync()
            except BaseException as exc:  # handed to the writer's thread
                ticket.error = exc
            ticket.seconds = time.perf_counter() - began
            self._done.put(ticket)
            os.write(self._back_w, b"\0")

    def close(self) -> None:
        """Stop the thread (after the ticket in flight, if any; the caller collects it first)."""
        self._todo.put(None)
        self._thread.join()
        os.close(self._back_r)
        os.close(self._back_w)
