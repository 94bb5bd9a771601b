"""The wire format: message types, their required fields, the header, and the limits.

A message is one multipart ZeroMQ message (after any ROUTER routing frames):

| frame | content                                                                    |
|-------|----------------------------------------------------------------------------|
| 0     | 16-byte header (below), immediately followed by the metadata, UTF-8 JSON   |
| 1..n  | one numpy array each, raw bytes, C order; dtype and shape in the metadata  |

Header, struct `<4sHHII` (little-endian):

| offset | size | field      | meaning                                                  |
|--------|------|------------|----------------------------------------------------------|
| 0      | 4    | magic      | b"IFW2" (the protocol and its version)                   |
| 4      | 2    | type       | a MessageType value                                      |
| 6      | 2    | flags      | Flag bits; an unknown bit is refused                     |
| 8      | 4    | n_arrays   | number of array frames; must equal frames - 1            |
| 12     | 4    | meta_bytes | length of the JSON after the header; must equal the rest |

Metadata JSON: `{"meta": {...}, "arrays": [[name, dtype, shape], ...]}`. `meta`
is the message's own fields; `arrays` describes frames 1..n in order. A dtype
is a numpy dtype string from ALLOWED_DTYPES or `|V<bytes>`, or a structured
dtype as a list of `[field name, dtype string]` pairs (numpy's `descr`; padding
fields have the name ""). A shape is a list of non-negative ints.

Message types (`meta` fields listed are required and type-checked both ways;
others may be added freely):

| value | type         | direction                  | required meta                                 |
|-------|--------------|----------------------------|-----------------------------------------------|
| 1     | SUBMIT_CHUNK | producer -> front          | job: str, chunk: int                          |
| 2     | CHUNK_ACK    | front -> producer          | job: str, chunk: int                          |
| 3     | CHUNK_ERROR  | front -> producer          | job: str, chunk: int, reason: str; RETRYABLE flag when a retry may succeed |
| 4     | HELLO        | producer -> front          | (none)                                        |
| 5     | CATALOG      | front -> producer          | models: list, lanes: list                     |
| 6     | JOB_STATUS   | producer -> front          | job: str                                      |
| 7     | JOB_INFO     | front -> producer          | job: str, exists: bool                        |
| 10    | ITEM_BATCH   | stage -> next stage        | ring: str, start: int, end: int, count: int   |
| 11    | APPEND_ACK   | writer -> front            | job_no: int, chunk: int, count: int; array `index` (u4: the items made durable, counted once each by the front) |
| 12    | TOKENIZE     | front -> tokenizer         | job_no: int, index: int, deadline_ns: int     |
| 13    | TOKENIZED    | tokenizer -> front         | job_no: int, chunk: int, forwarded: int, errors: list |
| 20    | PING         | any -> any                 | (none)                                        |
| 21    | PONG         | reply to PING              | (none)                                        |
| 30    | ERROR        | any -> sender of a message | reason: str; RETRYABLE flag as above          |
| 40-56 | worker, dispatch and completion messages: see docs/wire.md (dispatch and completion) | | |
| 57    | STATS        | stage -> supervisor        | stage: str, pid: int, samples: list (pipeline/telemetry/metrics.py) |
| 60-65 | results clients <-> completion: see docs/wire.md                              | | |

Ints in required fields are non-negative and below 2**64. ITEM_BATCH names a
record span of a shared-memory ring (pipeline/transport/ring.py): `start` is the ring's
head before the put, `end` what put() returned, `count` the items inside.

The codec is pipeline/transport/wire/codec.py, the socket side pipeline/transport/wire/sockets.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

import numpy as np

from pipeline.core.errors import ConfigError

MAGIC = b"IFW2"  # 2: work tokens on WORK, RESULTS and WORKER_HELLO (gpu/dispatch/work_token.py)
HEADER = struct.Struct("<4sHHII")
MAX_NAME_CHARS = 64  # an array's name, a structured dtype's field name
U64_LIMIT = 1 << 64


class MessageType(IntEnum):
    SUBMIT_CHUNK = 1
    CHUNK_ACK = 2
    CHUNK_ERROR = 3
    HELLO = 4
    CATALOG = 5
    JOB_STATUS = 6
    JOB_INFO = 7
    ITEM_BATCH = 10
    APPEND_ACK = 11
    TOKENIZE = 12
    TOKENIZED = 13
    PING = 20
    PONG = 21
    ERROR = 30
    WORKER_HELLO = 40
    WELCOME = 41
    WORK_REQUEST = 42
    WORK = 43
    NO_WORK = 44
    REPORT = 45
    RESULTS = 46
    RESULTS_ACK = 47
    HAND_BACK = 48
    BYE = 49
    UNKNOWN_SESSION = 50
    ITEM_ERRORS = 51
    RETIRED = 52
    APPENDED = 53
    CANCEL_JOB = 54
    BROKER_STATUS = 55
    BROKER_INFO = 56
    STATS = 57
    RESULTS_REFUSED = 58
    JOB_CONTROL = 59
    FETCH = 60
    RESULT_PAGE = 61
    CANCEL = 64
    CANCELLED = 65
    CONTROL = 66
    VECTORS_STATS = 70
    VECTORS_INFO = 71
    VECTORS_SEARCH = 72
    VECTORS_HITS = 73
    VECTORS_READ = 74
    VECTORS_ROWS = 75


class Flag(IntFlag):
    RETRYABLE = 1


NO_FLAGS = Flag(0)


REQUIRED_META: dict[MessageType, dict[str, type]] = {
    MessageType.SUBMIT_CHUNK: {"job": str, "chunk": int},
    MessageType.CHUNK_ACK: {"job": str, "chunk": int},
    MessageType.CHUNK_ERROR: {"job": str, "chunk": int, "reason": str},
    MessageType.ITEM_BATCH: {"ring": str, "start": int, "end": int, "count": int},
    MessageType.APPEND_ACK: {},
    MessageType.HELLO: {},
    MessageType.CATALOG: {"models": list, "lanes": list},
    MessageType.JOB_STATUS: {"job": str},
    MessageType.JOB_INFO: {"job": str, "exists": bool},
    MessageType.TOKENIZE: {"job_no": int, "index": int, "deadline_ns": int},
    MessageType.TOKENIZED: {"job_no": int, "chunk": int, "forwarded": int, "errors": list},
    MessageType.PING: {},
    MessageType.PONG: {},
    MessageType.ERROR: {"reason": str},
    MessageType.WORKER_HELLO: {"session": str, "model": str},
    MessageType.WELCOME: {"epoch": int, "lease_s": float, "report_s": float},
    MessageType.WORK_REQUEST: {"session": str, "model": str, "max_items": int, "max_tokens": int},
    MessageType.WORK: {"batch_id": int, "segment": int, "lane": int, "task": str},
    MessageType.NO_WORK: {"retry_ms": int},
    MessageType.REPORT: {"session": str, "seen_batch": int},
    MessageType.RESULTS: {"session": str, "result_id": int},
    MessageType.RESULTS_ACK: {"result_ids": list},
    MessageType.HAND_BACK: {"session": str, "reason": str},
    MessageType.BYE: {"session": str},
    MessageType.UNKNOWN_SESSION: {"session": str},
    MessageType.ITEM_ERRORS: {"reason": str},
    MessageType.RETIRED: {"acks": list},
    MessageType.APPENDED: {"segment": int, "end": int},
    MessageType.CANCEL_JOB: {"job_no": int},
    MessageType.JOB_CONTROL: {"job_no": int, "paused": bool, "priority": int},
    MessageType.BROKER_STATUS: {},
    MessageType.BROKER_INFO: {"epoch": int},
    MessageType.STATS: {"stage": str, "pid": int, "samples": list},
    MessageType.RESULTS_REFUSED: {"result_ids": list, "reason": str},
    MessageType.FETCH: {"job": str},
    MessageType.RESULT_PAGE: {"job": str, "page": int},
    MessageType.CANCEL: {"job": str},
    MessageType.CANCELLED: {"job": str, "state": str},
    MessageType.CONTROL: {"job": str},
    MessageType.VECTORS_STATS: {},
    MessageType.VECTORS_INFO: {"stores": list},
    MessageType.VECTORS_SEARCH: {"store": str, "k": int, "metric": str},
    MessageType.VECTORS_HITS: {"store": str},
    MessageType.VECTORS_READ: {"store": str, "shard": int, "first": int, "count": int},
    MessageType.VECTORS_ROWS: {"store": str, "shard": int, "first": int},
}


@dataclass(frozen=True)
class WireLimits:
    """What one message may carry; decode() refuses more, encode() refuses to build more."""

    max_frames: int = 64  # array frames + 1, routing frames not counted
    max_bytes: int = 1 << 30  # all frames together
    max_meta_bytes: int = 1 << 20  # the JSON after the header
    max_ndim: int = 8
    max_fields: int = 64  # fields of one structured dtype

    def __post_init__(self) -> None:
        for name in ("max_frames", "max_bytes", "max_meta_bytes", "max_ndim", "max_fields"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"WireLimits.{name} = {value!r}: must be a positive int")
        if self.max_ndim > 32:
            raise ConfigError(f"WireLimits.max_ndim = {self.max_ndim}: numpy allows at most 32")


DEFAULT_LIMITS = WireLimits()


@dataclass(frozen=True)
class Message:
    """A decoded message. `route` holds the ROUTER routing frames it came with (else empty)."""

    type: MessageType
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    flags: Flag = NO_FLAGS
    route: tuple[bytes, ...] = ()
    frames: tuple = field(default=(), compare=False, repr=False)  # as received, route cut off

    @property
    def retryable(self) -> bool:
        return bool(self.flags & Flag.RETRYABLE)


def show(value: object) -> str:
    """A repr short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
