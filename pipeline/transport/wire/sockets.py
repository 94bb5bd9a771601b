"""Messages on ZeroMQ sockets: send, receive, the two read loops, and socket set-up.

Every stage reads its ports the same way: a ROUTER port through `requests`
(a malformed request is answered, when it can be addressed, and skipped),
an internal PULL inbox through `Inbox` (a malformed message is logged,
counted and skipped). A bad message never stops a stage reading the next one.
Every socket is made by `open_socket`, which sets what each must have:
LINGER (default 0: close never waits for a gone peer), SNDTIMEO (default 0:
a send never blocks the stage), and the high-water marks when given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import zmq

from pipeline.core.errors import SendTimeoutError, WireError
from pipeline.transport.wire.codec import decode, encode
from pipeline.transport.wire.messages import DEFAULT_LIMITS, Flag, Message, MessageType, WireLimits


def send(
    socket: zmq.Socket,
    msg_type: MessageType | int,
    meta: dict[str, Any] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
    *,
    flags: Flag | int = 0,
    route: Sequence[bytes] = (),
    limits: WireLimits = DEFAULT_LIMITS,
) -> None:
    """Encode and send one message, arrays without copying, under the socket's SNDTIMEO.

    `route` (a received Message's route) addresses a ROUTER's peer. Do not
    modify the arrays afterwards: ZeroMQ may still be reading them.
    SendTimeoutError when SNDTIMEO passes; WireError for other socket errors.
    """
    frames = [*route, *encode(msg_type, meta, arrays, flags=flags, limits=limits)]
    try:
        socket.send_multipart(frames, copy=False)
    except zmq.Again as exc:
        raise SendTimeoutError(
            f"send of {MessageType(msg_type).name} timed out after SNDTIMEO "
            f"{socket.getsockopt(zmq.SNDTIMEO)} ms: peer gone or its queue full",
            tuple(route),
        ) from exc
    except zmq.ZMQError as exc:
        raise WireError(
            f"send of {MessageType(msg_type).name} failed: {exc}", tuple(route)
        ) from exc


def recv_frames(socket: zmq.Socket, timeout_ms: int) -> list[zmq.Frame] | None:
    """The next message's frames as received (not copied), or None if none arrives within
    `timeout_ms`; WireError if the receive fails."""
    try:
        if not socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    except zmq.ZMQError as exc:
        raise WireError(f"receive failed: {exc}") from exc


def recv(
    socket: zmq.Socket, timeout_ms: int, *, limits: WireLimits = DEFAULT_LIMITS
) -> Message | None:
    """The next message, or None if none arrives within `timeout_ms`.

    On a ROUTER socket the first frame (and an empty delimiter after it, from
    REQ peers) is the route. WireError (with `.route`) if the message is malformed.
    """
    frames = recv_frames(socket, timeout_ms)
    if frames is None:
        return None
    route: tuple[bytes, ...] = ()
    if socket.type == zmq.ROUTER:
        cut = 2 if len(frames) > 1 and len(frames[1]) == 0 else 1
        route = tuple(frame.bytes for frame in frames[:cut])
        frames = frames[cut:]
    return decode(frames, limits, route)


def requests(
    socket: zmq.Socket,
    most: int,
    limits: WireLimits,
    log,
    peer: str,
    refuse: Callable[[tuple[bytes, ...], str], None],
) -> Iterator[Message]:
    """Up to `most` waiting messages of a ROUTER port, without blocking. A malformed one is
    logged (naming the `peer` kind), answered through `refuse(route, reason)` when it can be
    addressed, and skipped: a bad message never stops the stage reading the next one."""
    for _ in range(most):
        try:
            message = recv(socket, 0, limits=limits)
        except WireError as exc:
            log.warning("dropped a malformed message from a %s: %s", peer, exc)
            if exc.route:
                refuse(exc.route, f"malformed message: {exc}")
            continue
        if message is None:
            return
        yield message


class Inbox:
    """A stage's internal inbox (a PULL socket, or a DEALER that reads another stage's
    answers): its waiting messages, read without stopping.

    A malformed message is logged (naming `peer`, where it came from), counted in
    `dropped`, and skipped. Internal peers are the broker's own stages, so one is a bug
    or a stray sender, never a reason to stop the stage.

    `receive` reads one message (default `recv`): a socket whose peer sends frames that
    need their own decoding passes its own function of the same signature (completion's
    inbox passes pipeline.transport.wire.forwarded.recv, for RESULTS dispatch forwards unparsed)."""

    def __init__(
        self,
        socket: zmq.Socket,
        log,
        peer: str,
        limits: WireLimits = DEFAULT_LIMITS,
        receive: Callable[..., Message | None] | None = None,
    ) -> None:
        self.socket = socket
        self.log = log
        self.peer = peer
        self.limits = limits
        self.receive = recv if receive is None else receive
        self.dropped = 0  # malformed messages skipped since the stage started

    def read(self, most: int, wait_ms: int = 0) -> Iterator[Message]:
        """Up to `most` messages; only the first read waits, at most `wait_ms`."""
        for n in range(most):
            try:
                message = self.receive(self.socket, wait_ms if n == 0 else 0, limits=self.limits)
            except WireError as exc:
                self.dropped += 1
                self.log.error("dropped a malformed message from %s: %s", self.peer, exc)
                continue
            if message is None:
                return
            yield message

    def drain(self, wait_ms: int = 0, most: int = 1024) -> int:
        """Read and discard up to `most` waiting messages (wakeups, whose work waits elsewhere);
        only the first read waits, at most `wait_ms`. How many well-formed ones were read."""
        return sum(1 for _ in self.read(most, wait_ms))


def open_socket(
    context: zmq.Context,
    kind: int,
    *,
    linger_ms: int = 0,
    send_timeout_ms: int = 0,
    send_hwm: int | None = None,
    recv_hwm: int | None = None,
    bind: str | None = None,
    connect: str | None = None,
) -> zmq.Socket:
    """A socket of `kind` set up as every stage needs: LINGER `linger_ms` (how long close waits
    for unsent messages), SNDTIMEO `send_timeout_ms` (0: a send that cannot go at once fails
    with SendTimeoutError instead of blocking the stage), the high-water marks when given;
    then bound or connected when an address is given (set anything else, such as CURVE keys,
    before binding: pass no address and bind it yourself)."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    if send_hwm is not None:
        socket.setsockopt(zmq.SNDHWM, send_hwm)
    if recv_hwm is not None:
        socket.setsockopt(zmq.RCVHWM, recv_hwm)
    if bind is not None:
        socket.bind(bind)
    if connect is not None:
        socket.connect(connect)
    return socket
