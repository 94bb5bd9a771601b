"""Results pass through dispatch unparsed: the frames a worker sent go on to completion as they are.

A forwarded RESULTS message on the dispatch -> completion PUSH socket:

| frame | content                                                                   |
|-------|---------------------------------------------------------------------------|
| 0     | `FORWARDED` (4 bytes, b"IFR1") followed by the worker's ROUTER identity   |
| 1..n  | the worker's RESULTS message, byte for byte as received (pipeline/wire.py) |

Every other message on that socket (ITEM_ERRORS) is an ordinary wire message,
whose frame 0 starts with wire.MAGIC (b"IFW2"), so the two cannot be confused.
Dispatch still decodes the worker's message as it came (zero-copy views: the
session, batch id, work token, `items` and `issued` it must check); it does not
build a new message from it. Completion decodes the frames once more, as it
does for anything it stores, and acknowledges to `meta["route"]`, which
`recv` sets from frame 0 (so a worker cannot choose where its ack goes).
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import zmq

from pipeline import wire
from pipeline.errors import WireError

FORWARDED = b"IFR1"  # frame 0 of a forwarded RESULTS: this, then the worker's route
MAX_WAITING_FOR_COMPLETION = 2048  # forwarded result batches held while completion is away


def forwarded(message: wire.Message) -> list:
    """The frames that forward a worker's RESULTS `message` (received by wire.recv) unchanged."""
    if not message.frames or len(message.route) != 1:
        raise WireError(
            f"{message.type.name}: {len(message.frames)} frame(s) and route {message.route!r}; "
            "only a message received on a ROUTER socket (one routing frame) can be forwarded"
        )
    return [FORWARDED + message.route[0], *message.frames]


def recv(
    socket: zmq.Socket, timeout_ms: int, *, limits: wire.WireLimits = wire.DEFAULT_LIMITS
) -> wire.Message | None:
    """wire.recv for the completion inbox: a forwarded RESULTS comes back decoded, with the
    worker's route (hex) in `meta["route"]` and in `route`; other messages as wire.recv gives them.
    WireError if malformed."""
    try:
        if not socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    except zmq.ZMQError as exc:
        raise WireError(f"receive failed: {exc}") from exc
    if not frames or bytes(frames[0].buffer[: len(FORWARDED)]) != FORWARDED:
        return wire.decode(frames, limits)
    route = bytes(frames[0].buffer[len(FORWARDED) :])
    message = wire.decode(frames[1:], limits, (route,))
    if message.type != wire.MessageType.RESULTS:
        raise WireError(f"a forwarded {message.type.name}: only RESULTS are forwarded")
    message.meta["route"] = route.hex()
    return message


class ToCompletion:
    """Dispatch's queue to the completion stage over `socket` (PUSH, SNDTIMEO 0): forwarded
    RESULTS and ITEM_ERRORS, in order; what cannot be sent now waits for the next flush."""

    def __init__(self, socket: zmq.Socket, log: logging.Logger) -> None:
        self.socket = socket
        self.log = log
        self.waiting: collections.deque[list] = collections.deque()  # frames, in order

    def results(self, message: wire.Message) -> None:
        """A worker's RESULTS (checked by the caller), as they came: not re-encoded."""
        if len(self.waiting) >= MAX_WAITING_FOR_COMPLETION:
            self.log.warning("completion is not taking results; dropped one batch (resent later)")
            return  # the worker keeps it unacknowledged and sends it again
        self.waiting.append(forwarded(message))

    def item_errors(self, reason: str, items: np.ndarray) -> None:
        self.waiting.append(
            wire.encode(wire.MessageType.ITEM_ERRORS, {"reason": reason}, {"items": items})
        )

    def flush(self) -> None:
        while self.waiting:
            try:
                self.socket.send_multipart(self.waiting[0], copy=False)
            except zmq.ZMQError:  # SNDTIMEO 0: zmq.Again
                return  # completion restarting or busy: keep them, try on the next step
            self.waiting.popleft()
