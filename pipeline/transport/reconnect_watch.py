"""A client hears that its connection to a broker stage was lost and is back.

A ZeroMQ DEALER reconnects on its own and says nothing: requests that were on
their way to a stage that died (the whole broker, or only that stage, killed
and restarted) are gone, and the client would learn it only from its own
answer timeout (the submit client's is 30 s). The socket monitor does say it:
DISCONNECTED when the peer goes, HANDSHAKE_SUCCEEDED when a new one (the
restarted stage) has taken the connection. `ReconnectWatch.back()` returns
the moment the connection was lost once it is back, so the client can send
again at once what it sent before then and heard nothing of (the broker
stores nothing twice: a chunk sent twice is answered as a duplicate).

The server side of the same monitor is ingest/peer_guard.py.
"""

from __future__ import annotations

import contextlib
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class ReconnectWatch:
    """The monitor of one connected socket."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.monitor = socket.get_monitor_socket(_EVENTS)
        self.lost_at: float | None = None  # monotonic time of a loss not yet followed by a peer

    def wait(self, timeout_ms: int) -> None:
        """Until the socket has a message, the monitor an event, or `timeout_ms` passed."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.poll(timeout_ms)

    def back(self) -> float | None:
        """Handle the events waiting (never blocks). The monotonic time the connection was
        lost, if a peer has taken it again since; else None (also on the first connect)."""
        back = None
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return back
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED and self.lost_at is None:
                self.lost_at = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.lost_at is not None:
                back, self.lost_at = self.lost_at, None

    def close(self) -> None:
        """Stop monitoring (before the socket is closed)."""
        with contextlib.suppress(zmq.ZMQError):  # the socket is closed already
            self.socket.disable_monitor()
        self.monitor.close(0)
