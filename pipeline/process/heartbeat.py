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

from pipeline.core.wake_pipe import WakePipe
from pipeline.transport.security import ServerGate

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
        self._wake = WakePipe()  # stop() makes it readable: the wait below ends at once
        self.started_s = time.monotonic()  # up_s is a duration: a wall-clock step cannot bend it

    def run(self) -> None:
        import zmq

        from pipeline.core.errors import FabricError
        from pipeline.transport import wire

        context = zmq.Context()
        socket = wire.open_socket(context, zmq.ROUTER)
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
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake.fd in ready:
                    return
                for message in wire.requests(socket, 64, limits, log, "heartbeat peer", _no_answer):
                    if message.type != wire.MessageType.PING:
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
        self._wake.wake()
        if self.is_alive():
            self.join(timeout=2.0)
        if not self.is_alive():
            self._wake.close()


def _no_answer(route: tuple[bytes, ...], reason: str) -> None:
    """A malformed message on the heartbeat port gets no answer (it is logged and skipped)."""
