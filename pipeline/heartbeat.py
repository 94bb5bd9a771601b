"""The stateless heartbeat port the supervisor answers: PING -> the broker's epoch, and
whether it recovered.

Answered by the supervisor itself (not by dispatch), so a worker hears the broker
is up even while dispatch is busy or restarting (docs/workers.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from pipeline.security import ServerGate

log = logging.getLogger("fabric.supervisor")
HEARTBEAT_MAX_MESSAGE_BYTES = 4096  # a PING is about 40 bytes; a bigger frame disconnects the peer


class Heartbeat(threading.Thread):
    """The stateless heartbeat port: answers PING with the broker's epoch and whether it recovered.

    Answered by the supervisor itself, so a worker hears the broker is up even
    while dispatch is busy or restarting.
    """

    def __init__(self, address: str, epoch: int, security=None) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.address = address
        self.epoch = epoch
        self.security = security  # SecuritySettings: CURVE on this port when it has a server key
        self.recovered = False
        self._stop_event = threading.Event()
        self.started_s = time.monotonic()  # up_s is a duration: a wall-clock step cannot bend it

    def run(self) -> None:
        import zmq

        from pipeline import wire
        from pipeline.errors import FabricError, WireError

        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, HEARTBEAT_MAX_MESSAGE_BYTES)
        limits = wire.WireLimits(max_frames=1, max_bytes=HEARTBEAT_MAX_MESSAGE_BYTES)
        gate = None
        try:
            if self.security is not None:
                gate = ServerGate(context, self.security)
                gate.secure(socket)
            socket.bind(self.address)
        except (zmq.ZMQError, FabricError) as exc:
            log.error("heartbeat port %s: cannot bind: %s", self.address, exc)
            socket.close(0)
            if gate is not None:
                gate.close()
            context.term()
            return
        try:
            while not self._stop_event.is_set():
                try:
                    message = wire.recv(socket, 100, limits=limits)
                except WireError as exc:
                    log.warning("heartbeat: dropped a malformed message: %s", exc)
                    continue
                if message is None or message.type != wire.MessageType.PING:
                    continue
                with contextlib.suppress(FabricError):
                    wire.send(
                        socket,
                        wire.MessageType.PONG,
                        {
                            "epoch": self.epoch,
                            "recovered": self.recovered,
                            "up_s": round(time.monotonic() - self.started_s, 3),
                        },
                        route=message.route,
                    )
        finally:
            socket.close(0)
            if gate is not None:
                gate.close()
            context.term()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)
