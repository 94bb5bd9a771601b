"""Connection caps on the producer port: how many connections one address, and all, may hold.

libzmq receives a frame whole before the front sees any of it: a peer that
announces a frame of up to `ingest.max_message_bytes` (ZeroMQ `MAXMSGSIZE`)
and sends most of it makes libzmq hold that much for the connection, and
nothing at the application level can see or refuse it. One peer doing so on
20 connections took the front from 74 MB to 1.28 GB. What bounds that memory
is the number of connections, so the front watches its ROUTER socket with a
ZeroMQ socket monitor (ACCEPTED and DISCONNECTED events carry the
connection's file descriptor) and shuts a connection down as soon as it is
accepted when its address already holds `ingest.max_peer_connections`, or
all together hold `ingest.max_connections`; libzmq then drops it and frees
whatever it buffered. With `RCVHWM` = 2 on the socket (two complete messages
waiting per connection, one being received; 1 stalls CURVE connections), what
producers can make the front hold before it reads a message is at most

    max_connections x 3 x max_message_bytes     (max_peer_connections x ... for one address)

The address is the peer's IP for TCP (every process on one host counts
together), "local" for IPC. A descriptor is known only between its ACCEPTED
and DISCONNECTED events; the guard acts on ACCEPTED at once, before the
peer's greeting is answered in most cases.
"""

from __future__ import annotations

import os
import socket
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

WARN_EVERY_S = 60.0  # one WARNING per address this often while its connections are cut
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class PeerGuard:
    """Counts the connections of one ROUTER socket by address and cuts those over the caps."""

    def __init__(
        self, router: zmq.Socket, max_connections: int, max_peer_connections: int, log
    ) -> None:
        self.max_connections = max_connections
        self.max_peer_connections = max_peer_connections
        self.log = log
        self.monitor = router.get_monitor_socket(_EVENTS)
        self.peers: dict[int, str] = {}  # descriptor -> address, for connections let in
        self.cut = 0  # connections cut in this life
        self._warned: dict[str, float] = {}

    def step(self, now: float) -> None:
        """Handle every monitor event waiting (never blocks)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd, now)
            else:
                self.peers.pop(fd, None)

    def by_address(self) -> Counter:
        return Counter(self.peers.values())

    def _accepted(self, fd: int, now: float) -> None:
        try:
            conn = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves libzmq's
        except OSError:
            return  # gone already
        try:
            try:
                name = conn.getpeername()
                address = name[0] if isinstance(name, tuple) else "local"
            except OSError:
                return
            held = sum(1 for a in self.peers.values() if a == address)
            if held < self.max_peer_connections and len(self.peers) < self.max_connections:
                self.peers[fd] = address
                return
            conn.shutdown(socket.SHUT_RDWR)  # libzmq sees the end and drops the connection
            self.cut += 1
            self._warn(address, held, now)
        finally:
            conn.close()

    def _warn(self, address: str, held: int, now: float) -> None:
        if now - self._warned.get(address, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        self._warned[address] = now
        if held >= self.max_peer_connections:
            why = f"{address} already holds {held} (ingest.max_peer_connections)"
        else:
            why = f"all peers hold {len(self.peers)} (ingest.max_connections)"
        self.log.warning(
            "cut a new connection from %s: %s; %d cut so far (one line per address a minute)",
            address,
            why,
            self.cut,
        )

    def close(self) -> None:
        self.monitor.close(0)
