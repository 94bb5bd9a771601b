"""Encoding and decoding one message (the format: pipeline/transport/wire/messages.py).

`decode()` never trusts its input: anything malformed (wrong magic, unknown
type, lying lengths or counts, bad JSON, disallowed dtypes, sizes that do
not match dtype x shape, more than WireLimits allows) raises WireError naming
the problem and the value, and nothing else. Decoded arrays are read-only
views of the received frames (no copy); they keep the frames alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import zmq

from pipeline.core.errors import WireError
from pipeline.transport.wire.dtypes import dtype_from_wire, dtype_to_wire
from pipeline.transport.wire.messages import (
    DEFAULT_LIMITS,
    HEADER,
    MAGIC,
    MAX_NAME_CHARS,
    REQUIRED_META,
    U64_LIMIT,
    Flag,
    Message,
    MessageType,
    WireLimits,
    show,
)


def check_meta(msg_type: MessageType, meta: object) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise WireError(f"{msg_type.name}: meta must be a JSON object, got {type(meta).__name__}")
    for key, kind in REQUIRED_META[msg_type].items():
        value = meta.get(key)
        if kind is int:  # numpy ints are fine going out (orjson writes them); JSON gives ints
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            ok = ok and 0 <= int(value) < U64_LIMIT
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise WireError(
                f"{msg_type.name}: meta field {key!r} = {show(value)} must be "
                f"{'an int in 0..2**64-1' if kind is int else 'a ' + kind.__name__}"
            )
    return meta


def message_type(value: object) -> MessageType:
    try:
        return MessageType(value)
    except ValueError:
        raise WireError(f"unknown message type {show(value)}") from None


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
    msg_type = message_type(msg_type)
    meta = check_meta(msg_type, {} if meta is None else meta)
    if int(flags) & ~int(Flag.RETRYABLE) or int(flags) < 0:
        raise WireError(f"{msg_type.name}: unknown flag bits in {int(flags):#x}")
    arrays = {} if arrays is None else arrays
    if len(arrays) + 1 > limits.max_frames:
        raise WireError(f"{msg_type.name}: {len(arrays)} arrays, limit is {limits.max_frames - 1}")
    specs = []
    frames: list = [b""]
    total = 0
    for name, array in arrays.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise WireError(
                f"{msg_type.name}: array name {show(name)} must be a str of 1..64 chars"
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
    msg_type = message_type(raw_type)
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
        raise WireError(f"{name}: metadata {show(envelope)} is not {{'meta': ..., 'arrays': ...}}")
    meta = check_meta(msg_type, envelope["meta"])
    specs = envelope["arrays"]
    if not isinstance(specs, list) or len(specs) != n_arrays:
        raise WireError(f"{name}: 'arrays' {show(specs)} must list {n_arrays} arrays")
    arrays: dict[str, np.ndarray] = {}
    for index, (spec, view) in enumerate(zip(specs, views[1:], strict=True), start=1):
        key, array = _array(f"{name} frame {index}", spec, view, arrays, limits)
        arrays[key] = array
    return Message(msg_type, meta, arrays, Flag(raw_flags), route, tuple(frames))


def _array(
    where: str, spec: object, view: memoryview, seen: dict, limits: WireLimits
) -> tuple[str, np.ndarray]:
    if not isinstance(spec, list) or len(spec) != 3:
        raise WireError(f"{where}: array spec {show(spec)} is not [name, dtype, shape]")
    name, dtype_spec, shape_spec = spec
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or name in seen:
        raise WireError(f"{where}: array name {show(name)} must be a new str of 1..64 chars")
    where = f"{where} ({name!r})"
    dtype = dtype_from_wire(dtype_spec, where, limits)
    if not isinstance(shape_spec, list) or len(shape_spec) > limits.max_ndim:
        raise WireError(
            f"{where}: shape {show(shape_spec)} must be a list of at most {limits.max_ndim} ints"
        )
    extent = (
        dtype.itemsize
    )  # bytes spanned by the non-zero dimensions; bounded, so numpy never overflows
    count = 1
    for dim in shape_spec:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise WireError(
                f"{where}: shape {show(shape_spec)} has dimension {show(dim)}, not an int >= 0"
            )
        extent *= max(dim, 1)
        count *= dim
        if extent > limits.max_bytes:
            raise WireError(
                f"{where}: shape {show(shape_spec)} spans more than {limits.max_bytes} bytes"
            )
    if count * dtype.itemsize != view.nbytes:
        raise WireError(
            f"{where}: dtype {dtype.str} x shape {shape_spec} is {count * dtype.itemsize} bytes, "
            f"the frame has {view.nbytes}"
        )
    array = np.frombuffer(view, dtype, count=count).reshape(shape_spec)
    array.flags.writeable = False  # over inproc the frame may be the sender's own array
    return name, array
