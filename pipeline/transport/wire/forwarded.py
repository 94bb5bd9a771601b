"""Results pass through dispatch unparsed: the frames a worker sent go on to completion as they are.

A forwarded RESULTS message on the dispatch -> completion PUSH socket:

| frame | content                                                                   |
|-------|---------------------------------------------------------------------------|
| 0     | `FORWARDED` (4 bytes, b"IFR1") followed by the worker's ROUTER identity   |
| 1..n  | the worker's RESULTS message, byte for byte as received (pipeline/transport/wire/) |

Every other message on that socket (ITEM_ERRORS) is an ordinary wire message,
whose frame 0 starts with wire.MAGIC (b"IFW2"), so the two cannot be confused.
Dispatch still decodes the worker's message as it came (zero-copy views: the
session, batch id, work token, `items` and `issued` it must check); it does not
build a new message from it (its queue to completion: gpu/dispatch/forward.py).
Completion decodes the frames once more, as it does for anything it stores, and
acknowledges to `meta["route"]`, which `recv` sets from frame 0 (so a worker
cannot choose where its ack goes).
"""

from __future__ import annotations

import zmq

from pipeline.core.errors import WireError
from pipeline.transport.wire.codec import decode
from pipeline.transport.wire.messages import DEFAULT_LIMITS, Message, MessageType, WireLimits
from pipeline.transport.wire.sockets import recv_frames

FORWARDED = b"IFR1"  # frame 0 of a forwarded RESULTS: this, then the worker's route


def forwarded(message: Message) -> list:
    """The frames that forward a worker's RESULTS `message` (received by the wire's recv) unchanged."""
    if not message.frames or len(message.route) != 1:
        raise WireError(
            f"{message.type.name}: {len(message.frames)} frame(s) and route {message.route!r}; "
            "only a message received on a ROUTER socket (one routing frame) can be forwarded"
        )
    return [FORWARDED + message.route[0], *message.frames]


def recv(
    socket: zmq.Socket, timeout_ms: int, *, limits: WireLimits = DEFAULT_LIMITS
) -> Message | None:
    """the wire's recv for the completion inbox: a forwarded RESULTS comes back decoded, with the
    worker's route (hex) in `meta["route"]` and in `route`; other messages as the wire's recv gives them.
    WireError if malformed."""
    frames = recv_frames(socket, timeout_ms)
    if frames is None:
        return None
    if not frames or bytes(frames[0].buffer[: len(FORWARDED)]) != FORWARDED:
        return decode(frames, limits)
    route = bytes(frames[0].buffer[len(FORWARDED) :])
    message = decode(frames[1:], limits, (route,))
    if message.type != MessageType.RESULTS:
        raise WireError(f"a forwarded {message.type.name}: only RESULTS are forwarded")
    message.meta["route"] = route.hex()
    return message
