"""A worker's sockets: a DEALER to dispatch and one to its heartbeat endpoint.

The dispatch socket's identity is the session id (a fresh random id per
process), so the broker routes replies to this process only. Both sockets
never block a send (`SNDTIMEO` 0) and queue nothing for a broker that is not
there (`IMMEDIATE`); a send that cannot go now returns False, and the
session retries on its own schedule. Both use the worker's CURVE keys when
it has them (pipeline/transport/security.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import zmq

from pipeline.core.errors import FabricError
from pipeline.transport import wire
from pipeline.transport.security import ClientCurve, secure_client

MT = wire.MessageType
# zmq's reconnect backoff ceiling, and the longest wait between hellos (gpu/worker/session.py):
# a worker is back within about 2 s of its broker, inside the default reregister_grace_s (5 s).
MAX_RECONNECT_S = 1.0
MAX_PONGS_PER_READ = 1024  # heartbeat answers read at once (a few arrive per second)
log = logging.getLogger("fabric.worker")


class Connection:
    """Open with `open()`; `send`, `poll`, `messages`, `ping`, `pongs`; then `close()`."""

    def __init__(self, broker: str, heartbeat: str | None, curve: ClientCurve | None, session: str):
        self.broker = broker
        self.heartbeat = heartbeat
        self.curve = curve
        self.session = session
        self.pinger: zmq.Socket | None = None

    def open(self) -> None:
        self.context = zmq.Context()
        self.socket = wire.open_socket(self.context, zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.session.encode())
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a broker that is not there
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, int(MAX_RECONNECT_S * 1000))
        secure_client(self.socket, self.curve)
        self.socket.connect(self.broker)
        self.inbox = wire.Inbox(self.socket, log, "the broker")
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        if self.heartbeat:
            self.pinger = wire.open_socket(self.context, zmq.DEALER)
            self.pinger.setsockopt(zmq.IMMEDIATE, 1)
            secure_client(self.pinger, self.curve)
            self.pinger.connect(self.heartbeat)
            self.pong_inbox = wire.Inbox(self.pinger, log, "the heartbeat endpoint")

    def close(self) -> None:
        self.socket.close(0)
        if self.pinger is not None:
            self.pinger.close(0)
        self.context.term()

    def send(self, kind: MT, meta: dict, arrays: dict | None = None) -> bool:
        """Send to dispatch with this session's id; False when it cannot go now."""
        try:
            wire.send(self.socket, kind, {"session": self.session, **meta}, arrays)
            return True
        except FabricError:
            return False

    def watch(self, fd: int) -> None:
        """Let a readable `fd` (the engine's outcomes) end `poll`'s wait too."""
        self.poller.register(fd, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> bool:
        """Whether dispatch sent something, waiting at most `timeout_ms` or until a watched
        fd is readable."""
        return self.socket in dict(self.poller.poll(timeout_ms))

    def messages(self, most: int) -> Iterator[wire.Message]:
        """Up to `most` waiting messages from dispatch (a malformed one logged and skipped)."""
        return self.inbox.read(most)

    def ping(self) -> None:
        """A PING on the heartbeat socket (nothing when there is none, or it cannot go)."""
        if self.pinger is not None:
            with contextlib.suppress(FabricError):
                wire.send(self.pinger, MT.PING, {})

    def pongs(self) -> Iterator[wire.Message]:
        """The heartbeat answers that arrived (malformed ones logged and skipped)."""
        if self.pinger is None:
            return
        yield from self.pong_inbox.read(MAX_PONGS_PER_READ)


def no_answer_advice(broker: str, curve: ClientCurve | None, seconds: float) -> str:
    """What to say when registering got no answer at all for `seconds`: keys are the usual
    cause, because a broker with keys answers a client it does not accept nothing at all."""
    if curve is None:
        keys = (
            "this worker has no key: a broker with keys (security.server_key) answers a "
            "client without one nothing at all; pass --key NAME.key_secret and --server-key "
            "BROKER.key"
        )
    else:
        keys = (
            "the broker answers nothing at all to a key it does not accept: check that this "
            "worker's public key is in the broker's authorized_keys and that --server-key is "
            "the broker's public key"
        )
    return (
        f"no answer from the broker at {broker} for {seconds:.0f} s; keys are the usual cause "
        f"({keys}); otherwise the broker is down or the address is wrong (docs/operations.md, "
        "Keys and authentication)"
    )
