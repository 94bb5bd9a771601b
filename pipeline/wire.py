"""The ZeroMQ message codec between stages, and between the broker and its clients.

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
| 11    | APPEND_ACK   | writer -> upstream         | (none; e.g. ring, end, segment, first, count) |
| 12    | TOKENIZE     | front -> tokenizer         | job_no: int, index: int, deadline_ns: int     |
| 13    | TOKENIZED    | tokenizer -> front         | job_no: int, chunk: int, forwarded: int, errors: list |
| 20    | PING         | any -> any                 | (none)                                        |
| 21    | PONG         | reply to PING              | (none)                                        |
| 30    | ERROR        | any -> sender of a message | reason: str; RETRYABLE flag as above          |
| 40-56 | worker, dispatch and completion messages: see docs/wire.md (dispatch and completion) | | |
| 57    | STATS        | stage -> supervisor        | stage: str, pid: int, samples: list (pipeline/metrics.py) |
| 60-65 | results clients <-> completion: see docs/wire.md                              | | |

Ints in required fields are non-negative and below 2**64. ITEM_BATCH names a
record span of a shared-memory ring (pipeline/ring.py): `start` is the ring's
head before the put, `end` what put() returned, `count` the items inside.

`decode()` never trusts its input: anything malformed (wrong magic, unknown
type, lying lengths or counts, bad JSON, disallowed dtypes, sizes that do
not match dtype x shape, more than WireLimits allows) raises WireError naming
the problem and the value, and nothing else. Decoded arrays are read-only
views of the received frames (no copy); they keep the frames alive.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

import numpy as np
import orjson
import zmq

from pipeline.errors import ConfigError, SendTimeoutError, WireError

MAGIC = b"IFW2"  # 2: work tokens on WORK, RESULTS and WORKER_HELLO (gpu/dispatch/work_token.py)
HEADER = struct.Struct("<4sHHII")
ALLOWED_DTYPES = frozenset(
    {"|u1", "<u1", "|i1", "<i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"}
)
_VOID_RE = re.compile(r"[|<]V([1-9][0-9]{0,5})\Z")  # raw bytes, 1..999999 per element
_MAX_NAME_CHARS = 64
_U64_LIMIT = 1 << 64


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
    FETCH = 60
    RESULT_PAGE = 61
    CANCEL = 64
    CANCELLED = 65
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
    MessageType.BROKER_STATUS: {},
    MessageType.BROKER_INFO: {"epoch": int},
    MessageType.STATS: {"stage": str, "pid": int, "samples": list},
    MessageType.RESULTS_REFUSED: {"result_ids": list, "reason": str},
    MessageType.FETCH: {"job": str},
    MessageType.RESULT_PAGE: {"job": str, "page": int},
    MessageType.CANCEL: {"job": str},
    MessageType.CANCELLED: {"job": str, "state": str},
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


def _show(value: object) -> str:
    """A repr short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- dtypes ------------------------------------------------------------------------------


def _scalar_dtype(spec: object) -> np.dtype | None:
    if not isinstance(spec, str):
        return None
    if spec in ALLOWED_DTYPES or _VOID_RE.match(spec):
        return np.dtype(spec)
    return None


def dtype_to_wire(dtype: np.dtype, where: str = "array") -> str | list[list[str]]:
    """The metadata form of an allowed dtype; WireError naming `where` for any other."""
    if dtype.names is None:
        wire = dtype.str
        if dtype.subdtype is None and _scalar_dtype(wire) is not None:
            return wire
    else:
        fields = []
        for entry in dtype.descr:
            if len(entry) != 2 or not isinstance(entry[0], str) or _scalar_dtype(entry[1]) is None:
                break
            fields.append([entry[0], entry[1]])
        else:
            try:  # the wire form must rebuild the same layout (numpy adds no hidden padding)
                rebuilt = np.dtype([(name, fmt) for name, fmt in fields])
                same = rebuilt.itemsize == dtype.itemsize and all(
                    rebuilt.fields[name][1] == spec[1] for name, spec in dtype.fields.items()
                )
            except (TypeError, ValueError, KeyError):
                same = False
            if same:
                return fields
    raise WireError(
        f"{where}: dtype {dtype!r} cannot go on the wire: use little-endian {sorted(ALLOWED_DTYPES)}, "
        "|V<n>, or a flat structured dtype of those (no sub-arrays, titles or objects)"
    )


def dtype_from_wire(spec: object, where: str, limits: WireLimits = DEFAULT_LIMITS) -> np.dtype:
    """The numpy dtype a metadata dtype names; WireError naming `where` if it is not allowed."""
    dtype = _scalar_dtype(spec)
    if dtype is not None:
        return dtype
    if isinstance(spec, list) and 0 < len(spec) <= limits.max_fields:
        fields = []
        for entry in spec:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and len(entry[0]) <= _MAX_NAME_CHARS
                and _scalar_dtype(entry[1]) is not None
            ):
                raise WireError(
                    f"{where}: structured dtype field {_show(entry)} is not [name, dtype]"
                )
            fields.append((entry[0], entry[1]))
        try:
            return np.dtype(fields)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{where}: structured dtype {_show(spec)} is invalid: {exc}") from exc
    raise WireError(
        f"{where}: dtype {_show(spec)} is not allowed; use one of {sorted(ALLOWED_DTYPES)}, "
        f"|V<n>, or a list of at most {limits.max_fields} [name, dtype] pairs"
    )


# ---- metadata ----------------------------------------------------------------------------


def _check_meta(msg_type: MessageType, meta: object) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise WireError(f"{msg_type.name}: meta must be a JSON object, got {type(meta).__name__}")
    for key, kind in REQUIRED_META[msg_type].items():
        value = meta.get(key)
        if kind is int:  # numpy ints are fine going out (orjson writes them); JSON gives ints
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            ok = ok and 0 <= int(value) < _U64_LIMIT
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise WireError(
                f"{msg_type.name}: meta field {key!r} = {_show(value)} must be "
                f"{'an int in 0..2**64-1' if kind is int else 'a ' + kind.__name__}"
            )
    return meta


def _message_type(value: object) -> MessageType:
    try:
        return MessageType(value)
    except ValueError:
        raise WireError(f"unknown message type {_show(value)}") from None


# ---- encode ------------------------------------------------------------------------------


def encode(
    msg_type: MessageType | int,
    meta: dict[str, Any] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
    *,
    flags: Flag | int = 0,
    limits: WireLimits = DEFAULT_LIMITS,
) -> list:
    """The frames of one message: [header + JSON bytes, *arrays].

    The arrays themselves are returned (C-contiguous ones are not copied;
    others are copied once into C order), ready for send_multipart(copy=False).
    """
    msg_type = _message_type(msg_type)
    meta = _check_meta(msg_type, {} if meta is None else meta)
    if int(flags) & ~int(Flag.RETRYABLE) or int(flags) < 0:
        raise WireError(f"{msg_type.name}: unknown flag bits in {int(flags):#x}")
    arrays = {} if arrays is None else arrays
    if len(arrays) + 1 > limits.max_frames:
        raise WireError(f"{msg_type.name}: {len(arrays)} arrays, limit is {limits.max_frames - 1}")
    specs = []
    frames: list = [b""]
    total = 0
    for name, array in arrays.items():
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME_CHARS:
            raise WireError(
                f"{msg_type.name}: array name {_show(name)} must be a str of 1..64 chars"
            )
        if not isinstance(array, np.ndarray):
            raise WireError(
                f"{msg_type.name}: array {name!r} is a {type(array).__name__}, not a numpy array"
            )
        if array.ndim > limits.max_ndim:
            raise WireError(
                f"{msg_type.name}: array {name!r} has {array.ndim} dims, limit {limits.max_ndim}"
            )
        wire_dtype = dtype_to_wire(array.dtype, f"{msg_type.name}: array {name!r}")
        specs.append([name, wire_dtype, list(array.shape)])
        frames.append(array if array.flags.c_contiguous else array.copy(order="C"))
        total += array.nbytes
    try:
        body = orjson.dumps({"meta": meta, "arrays": specs}, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise WireError(f"{msg_type.name}: meta is not JSON-serialisable: {exc}") from exc
    if len(body) > limits.max_meta_bytes:
        raise WireError(
            f"{msg_type.name}: metadata is {len(body)} bytes, limit {limits.max_meta_bytes}"
        )
    frames[0] = HEADER.pack(MAGIC, msg_type, int(flags), len(specs), len(body)) + body
    if total + len(frames[0]) > limits.max_bytes:
        raise WireError(
            f"{msg_type.name}: message is {total + len(frames[0])} bytes, limit {limits.max_bytes}"
        )
    return frames


# ---- decode ------------------------------------------------------------------------------


def _frame_buffer(frame: object, index: int) -> memoryview:
    """A flat byte view of one received frame, without copying."""
    if isinstance(frame, zmq.Frame):
        view = frame.buffer
    elif isinstance(frame, np.ndarray):
        if not frame.flags.c_contiguous:
            raise WireError(f"frame {index}: array is not C-contiguous")
        view = memoryview(frame.reshape(-1).view(np.uint8))
    elif isinstance(frame, (bytes, bytearray, memoryview)):
        view = memoryview(frame)
    else:
        raise WireError(f"frame {index}: a {type(frame).__name__} is not a message frame")
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise WireError(f"frame {index}: buffer is not contiguous")
        view = view.cast("B")
    return view


def decode(
    frames: Sequence[object], limits: WireLimits = DEFAULT_LIMITS, route: tuple[bytes, ...] = ()
) -> Message:
    """The message these frames carry (routing frames already removed); WireError if malformed.

    `route` is only passed through, onto the Message or the WireError.
    """
    try:
        return _decode(frames, limits, route)
    except WireError as exc:
        exc.route = route
        raise


def _decode(frames: Sequence[object], limits: WireLimits, route: tuple[bytes, ...]) -> Message:
    if not isinstance(frames, (list, tuple)):
        raise WireError(f"frames must be a list, got {type(frames).__name__}")
    if not frames:
        raise WireError("empty message: no header frame")
    if len(frames) > limits.max_frames:
        raise WireError(f"{len(frames)} frames, limit is {limits.max_frames}")
    views = [_frame_buffer(frame, i) for i, frame in enumerate(frames)]
    total = sum(view.nbytes for view in views)
    if total > limits.max_bytes:
        raise WireError(f"message is {total} bytes, limit is {limits.max_bytes}")
    head = views[0]
    if head.nbytes < HEADER.size:
        raise WireError(f"truncated header: frame 0 is {head.nbytes} bytes, need {HEADER.size}")
    magic, raw_type, raw_flags, n_arrays, meta_bytes = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}, want {MAGIC!r}: not an Inference Fabric message")
    msg_type = _message_type(raw_type)
    name = msg_type.name
    if raw_flags & ~int(Flag.RETRYABLE):
        raise WireError(f"{name}: unknown flag bits in {raw_flags:#x}")
    if n_arrays != len(frames) - 1:
        raise WireError(
            f"{name}: header says {n_arrays} array frames, message has {len(frames) - 1}"
        )
    if meta_bytes != head.nbytes - HEADER.size:
        raise WireError(
            f"{name}: header says {meta_bytes} metadata bytes, frame 0 carries "
            f"{head.nbytes - HEADER.size}"
        )
    if meta_bytes > limits.max_meta_bytes:
        raise WireError(f"{name}: metadata is {meta_bytes} bytes, limit {limits.max_meta_bytes}")
    try:
        envelope = orjson.loads(head[HEADER.size :])
    except orjson.JSONDecodeError as exc:
        raise WireError(f"{name}: metadata is not valid JSON: {exc}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"meta", "arrays"}:
        raise WireError(f"{name}: metadata {_show(envelope)} is not {{'meta': ..., 'arrays': ...}}")
    meta = _check_meta(msg_type, envelope["meta"])
    specs = envelope["arrays"]
    if not isinstance(specs, list) or len(specs) != n_arrays:
        raise WireError(f"{name}: 'arrays' {_show(specs)} must list {n_arrays} arrays")
    arrays: dict[str, np.ndarray] = {}
    for index, (spec, view) in enumerate(zip(specs, views[1:], strict=True), start=1):
        key, array = _array(f"{name} frame {index}", spec, view, arrays, limits)
        arrays[key] = array
    return Message(msg_type, meta, arrays, Flag(raw_flags), route, tuple(frames))


def _array(
    where: str, spec: object, view: memoryview, seen: dict, limits: WireLimits
) -> tuple[str, np.ndarray]:
    if not isinstance(spec, list) or len(spec) != 3:
        raise WireError(f"{where}: array spec {_show(spec)} is not [name, dtype, shape]")
    name, dtype_spec, shape_spec = spec
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME_CHARS or name in seen:
        raise WireError(f"{where}: array name {_show(name)} must be a new str of 1..64 chars")
    where = f"{where} ({name!r})"
    dtype = dtype_from_wire(dtype_spec, where, limits)
    if not isinstance(shape_spec, list) or len(shape_spec) > limits.max_ndim:
        raise WireError(
            f"{where}: shape {_show(shape_spec)} must be a list of at most {limits.max_ndim} ints"
        )
    extent = (
        dtype.itemsize
    )  # bytes spanned by the non-zero dimensions; bounded, so numpy never overflows
    count = 1
    for dim in shape_spec:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise WireError(
                f"{where}: shape {_show(shape_spec)} has dimension {_show(dim)}, not an int >= 0"
            )
        extent *= max(dim, 1)
        count *= dim
        if extent > limits.max_bytes:
            raise WireError(
                f"{where}: shape {_show(shape_spec)} spans more than {limits.max_bytes} bytes"
            )
    if count * dtype.itemsize != view.nbytes:
        raise WireError(
            f"{where}: dtype {dtype.str} x shape {shape_spec} is {count * dtype.itemsize} bytes, "
            f"the frame has {view.nbytes}"
        )
    array = np.frombuffer(view, dtype, count=count).reshape(shape_spec)
    array.flags.writeable = False  # over inproc the frame may be the sender's own array
    return name, array


# ---- sockets -----------------------------------------------------------------------------


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


def recv(
    socket: zmq.Socket, timeout_ms: int, *, limits: WireLimits = DEFAULT_LIMITS
) -> Message | None:
    """The next message, or None if none arrives within `timeout_ms`.

    On a ROUTER socket the first frame (and an empty delimiter after it, from
    REQ peers) is the route. WireError (with `.route`) if the message is malformed.
    """
    try:
        if not socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    except zmq.ZMQError as exc:
        raise WireError(f"receive failed: {exc}") from exc
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
