"""The ZeroMQ messages between stages, and between the broker and its clients.

| module     | what it holds                                                          |
|------------|------------------------------------------------------------------------|
| messages   | the format: header, message types and their required fields, limits    |
| dtypes     | which numpy dtypes may cross the wire, and their metadata form         |
| codec      | `encode` and `decode` of one message, never trusting what it decodes   |
| sockets    | `send`, `recv`, the read loops (`requests`, `Inbox`), `open_socket`    |

Callers use the package (`from pipeline import wire`; `wire.send`, `wire.MessageType`);
docs/wire.md explains the protocol.
"""

from pipeline.core.errors import WireError  # what every reader of the wire catches
from pipeline.transport.wire.codec import check_meta, decode, encode
from pipeline.transport.wire.dtypes import ALLOWED_DTYPES, dtype_from_wire, dtype_to_wire
from pipeline.transport.wire.messages import (
    DEFAULT_LIMITS,
    HEADER,
    MAGIC,
    NO_FLAGS,
    REQUIRED_META,
    Flag,
    Message,
    MessageType,
    WireLimits,
)
from pipeline.transport.wire.sockets import Inbox, open_socket, recv, requests, send

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_LIMITS",
    "HEADER",
    "MAGIC",
    "NO_FLAGS",
    "REQUIRED_META",
    "Flag",
    "Inbox",
    "Message",
    "MessageType",
    "WireError",
    "WireLimits",
    "check_meta",
    "decode",
    "dtype_from_wire",
    "dtype_to_wire",
    "encode",
    "open_socket",
    "recv",
    "requests",
    "send",
]
