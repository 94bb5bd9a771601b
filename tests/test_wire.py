"""The wire codec: round trips, zero copy, hostile frames, and real ROUTER/DEALER loopbacks."""

from __future__ import annotations

import shutil
import struct
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
import zmq
from conftest import fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import SendTimeoutError, WireError
from pipeline.transport.wire import (
    HEADER,
    MAGIC,
    REQUIRED_META,
    Flag,
    Inbox,
    Message,
    MessageType,
    WireLimits,
    decode,
    encode,
    open_socket,
    recv,
    send,
)

ITEMS = np.dtype([("seq", "<u8"), ("slot", "<u4"), ("lane", "<u2")])
BATCH = {"ring": "/ifabc.router.writer.0", "start": 4096, "end": 8192, "count": 3}


def frame0(msg_type: int, envelope: object, *, n_arrays: int = 0, flags: int = 0) -> bytes:
    body = orjson.dumps(envelope)
    return HEADER.pack(MAGIC, msg_type, flags, n_arrays, len(body)) + body


def sample_arrays() -> dict[str, np.ndarray]:
    items = np.zeros(3, ITEMS)
    items["seq"] = [1, 2, 1 << 60]
    items["lane"] = [64, 128, 256]
    return {
        "tokens": np.arange(100_000, dtype=np.uint32),  # above pyzmq's copy threshold
        "items": items,
        "empty": np.zeros((0, 16), np.float16),
        "scores": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
        "scalar": np.array(-7, np.int64),
        "raw": np.frombuffer(b"0123456789abcdef", "V8"),
    }


def assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


# ---- codec -------------------------------------------------------------------------------


def test_round_trip_with_structured_empty_and_scalar_arrays():
    arrays = sample_arrays()
    frames = encode(MessageType.ITEM_BATCH, BATCH, arrays)
    assert len(frames) == 1 + len(arrays)
    message = decode(frames)
    assert message.type is MessageType.ITEM_BATCH
    assert message.meta == BATCH
    assert message.flags == Flag(0) and not message.retryable and message.route == ()
    assert_same_arrays(message.arrays, arrays)
    assert message.arrays["items"]["seq"][2] == 1 << 60
    # Numpy ints in meta go out as JSON ints (a ring position is often one).
    numpy_meta = {**BATCH, "end": np.uint64(8192), "count": np.int32(3)}
    assert decode(encode(MessageType.ITEM_BATCH, numpy_meta)).meta == BATCH


SAMPLE_VALUES = {str: "j1", int: 7, float: 2.5, bool: True, list: [1, "a", None]}


def test_round_trip_of_every_type_with_bytes_frames():
    for msg_type in MessageType:
        meta = {key: SAMPLE_VALUES[kind] for key, kind in REQUIRED_META[msg_type].items()}
        meta["extra"] = {"nested": [1, None, 2.5]}
        frames = encode(msg_type, meta, {"x": np.arange(3, dtype=np.uint8)}, flags=Flag.RETRYABLE)
        message = decode([bytes(memoryview(frame)) for frame in frames])
        assert (message.type, message.meta, message.retryable) == (msg_type, meta, True)
        for key in REQUIRED_META[msg_type]:
            with pytest.raises(WireError, match=f"{msg_type.name}: meta field {key!r} = None"):
                encode(msg_type, {k: v for k, v in meta.items() if k != key})


def test_encode_returns_contiguous_arrays_themselves_and_copies_only_strided_ones():
    tokens = np.arange(64, dtype=np.uint32)
    strided = np.arange(64, dtype=np.uint32)[::2]
    frames = encode(MessageType.PING, None, {"tokens": tokens, "strided": strided})
    assert frames[1] is tokens
    assert frames[2].flags.c_contiguous and np.array_equal(frames[2], strided)


def test_decode_is_zero_copy_for_zmq_frames_and_bytes():
    arrays = {"tokens": np.arange(1000, dtype=np.uint32)}
    head, body = encode(MessageType.PING, {}, arrays)
    zframe = zmq.Frame(body.tobytes())
    decoded = decode([zmq.Frame(head), zframe]).arrays["tokens"]
    assert np.shares_memory(decoded, np.frombuffer(zframe.buffer, np.uint8))
    assert not decoded.flags.writeable and not decoded.flags.owndata
    raw = bytearray(body.tobytes())
    decoded = decode([head, raw]).arrays["tokens"]
    raw[0:4] = b"\xff\xff\xff\xff"  # the decoded array is a view of the frame
    assert decoded[0] == 0xFFFFFFFF


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(WireError, match="unknown message type 99"):
        encode(99, {})
    with pytest.raises(WireError, match=r"ITEM_BATCH: meta field 'start' = -1"):
        encode(MessageType.ITEM_BATCH, {**BATCH, "start": -1})
    with pytest.raises(WireError, match=r"CHUNK_ACK: meta field 'chunk' = True"):
        encode(MessageType.CHUNK_ACK, {"job": "j", "chunk": True})
    with pytest.raises(WireError, match=r"array 'big': dtype dtype\('>u4'\)"):
        encode(MessageType.PING, {}, {"big": np.zeros(2, ">u4")})
    with pytest.raises(WireError, match=r"array 'objs': dtype dtype\('O'\)"):
        encode(MessageType.PING, {}, {"objs": np.array([object()])})
    with pytest.raises(WireError, match="array 'list' is a list"):
        encode(MessageType.PING, {}, {"list": [1, 2]})
    with pytest.raises(WireError, match="not JSON-serialisable"):
        encode(MessageType.PING, {"when": object()})
    with pytest.raises(WireError, match="unknown flag bits in 0x4"):
        encode(MessageType.PING, {}, flags=4)
    with pytest.raises(WireError, match="3 arrays, limit is 2"):
        encode(
            MessageType.PING, {}, {n: np.zeros(1) for n in "abc"}, limits=WireLimits(max_frames=3)
        )


# ---- hostile input -------------------------------------------------------------------------


def good_frames() -> list:
    return encode(MessageType.ITEM_BATCH, BATCH, {"items": np.zeros(3, ITEMS), "t": np.arange(5)})


HOSTILE = [
    ([], "empty message"),
    ([b"IFW1"], "truncated header: frame 0 is 4 bytes, need 16"),
    ([b"XXXX" + bytes(12)], r"bad magic b'XXXX'"),
    ([frame0(999, {"meta": {}, "arrays": []})], "unknown message type 999"),
    ([frame0(20, {"meta": {}, "arrays": []}, flags=0x80)], "unknown flag bits in 0x80"),
    (
        [frame0(20, {"meta": {}, "arrays": []}, n_arrays=2)],
        "header says 2 array frames, message has 0",
    ),
    (
        [HEADER.pack(MAGIC, 20, 0, 0, 50) + b"{}"],
        "header says 50 metadata bytes, frame 0 carries 2",
    ),
    ([HEADER.pack(MAGIC, 20, 0, 0, 3) + b"{x}"], "metadata is not valid JSON"),
    ([frame0(20, [1, 2])], r"metadata \[1, 2\] is not"),
    ([frame0(20, {"meta": [], "arrays": []})], "meta must be a JSON object, got list"),
    ([frame0(10, {"meta": {"ring": "r"}, "arrays": []})], "meta field 'start' = None"),
    ([frame0(20, {"meta": {}, "arrays": [["a", "<u4", [2]]]}, n_arrays=1), b"12345678"], None),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", "<u4", [3]]]}, n_arrays=1), b"12345678"],
        r"dtype <u4 x shape \[3\] is 12 bytes, the frame has 8",
    ),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", "|O", [1]]]}, n_arrays=1), bytes(8)],
        "dtype '|O' is not allowed",
    ),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", ">u4", [1]]]}, n_arrays=1), bytes(4)],
        "dtype '>u4' is not allowed",
    ),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", "<u4", [-1]]]}, n_arrays=1), b""],
        r"dimension -1, not an int >= 0",
    ),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", "<u4", [0, 1 << 40]]]}, n_arrays=1), b""],
        "spans more than",
    ),
    (
        [frame0(20, {"meta": {}, "arrays": [["a", "<u4", [1 << 62, 1 << 62]]]}, n_arrays=1), b""],
        "spans more than",
    ),
    (
        [
            frame0(
                20, {"meta": {}, "arrays": [["a", [["x", "<u4"], ["x", "<u4"]], [1]]]}, n_arrays=1
            ),
            bytes(8),
        ],
        "structured dtype .* is invalid",
    ),
    (
        [
            frame0(20, {"meta": {}, "arrays": [["a", [["x", ["y", "<u4"]]], [1]]]}, n_arrays=1),
            bytes(4),
        ],
        "is not \\[name, dtype\\]",
    ),
    (
        [
            frame0(20, {"meta": {}, "arrays": [["a", "<u1", [1]], ["a", "<u1", [1]]]}, n_arrays=2),
            b"x",
            b"y",
        ],
        "array name 'a' must be a new str",
    ),
    ([frame0(20, {"meta": {}, "arrays": "nope"}, n_arrays=0)], "'arrays' 'nope' must list 0"),
    ([frame0(20, {"meta": {}, "arrays": []}), 42], "frame 1: a int is not a message frame"),
]


@pytest.mark.parametrize(("frames", "problem"), HOSTILE)
def test_decode_refuses_hostile_frames_naming_the_problem(frames, problem):
    if problem is None:
        assert decode(frames).arrays["a"].tolist() == list(struct.unpack("<2I", frames[1]))
        return
    with pytest.raises(WireError, match=problem):
        decode(frames)


def test_decode_applies_the_limits():
    frames = good_frames()
    with pytest.raises(WireError, match="3 frames, limit is 2"):
        decode(frames, WireLimits(max_frames=2))
    with pytest.raises(WireError, match=r"message is \d+ bytes, limit is 100"):
        decode(frames, WireLimits(max_bytes=100))
    with pytest.raises(WireError, match=r"metadata is \d+ bytes, limit 10"):
        decode(frames, WireLimits(max_meta_bytes=10))
    deep = [frame0(20, {"meta": {}, "arrays": [["a", "<u1", [1] * 9]]}, n_arrays=1), b"x"]
    with pytest.raises(WireError, match="at most 8 ints"):
        decode(deep)


def test_errors_carry_the_route_they_came_with():
    with pytest.raises(WireError) as caught:
        decode([b"junk"], route=(b"\x00peer",))
    assert caught.value.route == (b"\x00peer",)


def mutated(frames: list, data) -> list:
    """A valid message with one hostile change."""
    raw = [frame.tobytes() if isinstance(frame, np.ndarray) else bytes(frame) for frame in frames]
    index = data.draw(st.integers(0, len(raw) - 1))
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "add", "swap-json"]))
    frame = bytearray(raw[index])
    if action == "flip" and frame:
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del frame[data.draw(st.integers(0, len(frame))) :]
    elif action == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=16))
    elif action == "drop" and len(raw) > 1:
        raw.pop(index)
        return raw
    elif action == "add":
        raw.insert(index + 1, data.draw(st.binary(max_size=32)))
        return raw
    elif action == "swap-json":
        body = orjson.dumps(data.draw(json_values))
        frame = bytearray(raw[0][:16] + body)
        struct.pack_into("<I", frame, 12, len(body))
        index = 0
    raw[index] = bytes(frame)
    return raw


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
dtype_specs = st.one_of(
    st.sampled_from(
        ["<u1", "|u1", "<u4", "<i8", "<f2", "|V3", "|V0", "<V8", ">u4", "|O", "<U4", "S3", ""]
    ),
    st.lists(
        st.lists(st.text(max_size=3) | st.sampled_from(["<u4", "|V2", "<f8"]), max_size=3),
        max_size=3,
    ),
    json_values,
)
shapes = st.lists(
    st.sampled_from([0, 1, 2**31, 2**62, 2**64 - 1]) | st.integers(-3, 4) | st.integers(-3, 2**63),
    max_size=9,
)
array_specs = st.lists(
    st.tuples(st.text(max_size=4) | json_values, dtype_specs, shapes | json_values).map(list),
    max_size=3,
)


def check(frames) -> None:
    try:
        message = decode(frames, WireLimits(max_bytes=1 << 20))
    except WireError:
        return
    assert isinstance(message, Message)
    for array in message.arrays.values():
        array.tobytes()  # every decoded array is fully readable


@settings(max_examples=fuzz_examples(150), deadline=None, database=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_decode_of_random_frames_only_raises_wire_error(frames):
    check(frames)


@settings(max_examples=fuzz_examples(200), deadline=None, database=None)
@given(st.data())
def test_decode_of_plausible_headers_only_raises_wire_error(data):
    """Mostly well-formed headers and envelopes, so the checks deep inside are reached too."""
    msg_type = data.draw(
        st.sampled_from([MessageType.PING, MessageType.APPEND_ACK]) | st.integers(0, 0xFFFF)
    )
    meta = data.draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3) | json_values)
    specs = data.draw(array_specs | json_values)
    envelope = data.draw(st.just({"meta": meta, "arrays": specs}) | json_values)
    n_bodies = len(specs) if isinstance(specs, list) else 0
    n_bodies = data.draw(st.just(n_bodies) | st.integers(0, 3))
    bodies = data.draw(
        st.lists(st.binary(max_size=48) | st.just(b""), min_size=n_bodies, max_size=n_bodies)
    )
    flags = data.draw(st.just(0) | st.integers(0, 0xFFFF))
    check([frame0(msg_type, envelope, n_arrays=len(bodies), flags=flags), *bodies])


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """`good` three times in four, so a draw gets past the early checks more often than not."""
    return st.one_of(good, good, good, bad)


good_dtypes = st.sampled_from(["<u1", "|u1", "<u4", "<i8", "<f2", "|V3", "<V8"]) | st.lists(
    st.tuples(st.sampled_from(["x", "y", ""]), st.sampled_from(["<u4", "|V2", "<f8"])).map(list),
    min_size=1,
    max_size=3,
)


def claimed_bytes(dtype: object, shape: object) -> int:
    """abs(dtype x shape) as numpy would read the spec, or -1 when it cannot say."""
    try:
        fields = [tuple(field) for field in dtype] if isinstance(dtype, list) else dtype
        return abs(np.dtype(fields).itemsize * int(np.prod(shape, dtype=object)))
    except Exception:
        return -1


@settings(max_examples=fuzz_examples(200), deadline=None, database=None)
@given(st.data())
def test_decode_of_hostile_array_specs_only_raises_wire_error(data):
    """One array whose frame often has exactly the size its spec claims, so decode gets far."""
    name = data.draw(mostly(st.sampled_from(["a", "tokens"]), st.text(max_size=70) | json_values))
    dtype = data.draw(mostly(good_dtypes, dtype_specs))
    shape = data.draw(mostly(shapes, json_values))
    size = claimed_bytes(dtype, shape)
    exact = st.just(bytes(size)) if 0 <= size <= 4096 else st.just(b"")
    body = data.draw(exact | st.binary(max_size=64))
    check(
        [frame0(MessageType.PING, {"meta": {}, "arrays": [[name, dtype, shape]]}, n_arrays=1), body]
    )


@settings(
    max_examples=fuzz_examples(150),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_decode_of_mutated_valid_messages_only_raises_wire_error(data):
    check(mutated(good_frames(), data))


# ---- real sockets --------------------------------------------------------------------------


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()  # hangs, and the per-test timeout fails the test, if a socket was left open


@pytest.fixture
def sockets(context):
    """Make sockets with linger=0 and timeouts; all are closed at teardown."""
    made = []

    def make(kind: int) -> zmq.Socket:
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, 5000)
        socket.setsockopt(zmq.SNDTIMEO, 5000)
        made.append(socket)
        return socket

    yield make
    for socket in made:
        socket.close(linger=0)


@pytest.fixture
def ipc_dir():
    path = tempfile.mkdtemp(prefix="ifw-", dir="/tmp")  # short: ipc paths are limited to ~107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def loopback(router: zmq.Socket, dealer: zmq.Socket) -> None:
    arrays = sample_arrays()
    meta = {"job": "job-1", "chunk": 7, "model": "minilm"}
    send(dealer, MessageType.SUBMIT_CHUNK, meta, arrays)
    message = recv(router, timeout_ms=5000)
    assert message is not None, "the ROUTER received nothing within 5 s"
    assert (message.type, message.meta) == (MessageType.SUBMIT_CHUNK, meta)
    assert len(message.route) == 1
    assert_same_arrays(message.arrays, arrays)
    assert not message.arrays["tokens"].flags.owndata  # a view of the received frame
    send(
        router,
        MessageType.CHUNK_ERROR,
        {**meta, "reason": "full"},
        flags=Flag.RETRYABLE,
        route=message.route,
    )
    reply = recv(dealer, timeout_ms=5000)
    assert reply is not None and reply.type is MessageType.CHUNK_ERROR and reply.retryable
    assert reply.route == ()
    # A hostile peer: the front learns who sent it, and can answer.
    dealer.send_multipart([b"garbage"])
    with pytest.raises(WireError, match="truncated header") as caught:
        recv(router, timeout_ms=5000)
    assert caught.value.route == message.route
    assert recv(dealer, timeout_ms=0) is None


def test_router_dealer_loopback_over_tcp(sockets):
    router = sockets(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = sockets(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    loopback(router, dealer)


def test_router_dealer_loopback_over_ipc(sockets, ipc_dir):
    address = f"ipc://{ipc_dir}/front.sock"
    router = sockets(zmq.ROUTER)
    router.bind(address)
    dealer = sockets(zmq.DEALER)
    dealer.connect(address)
    loopback(router, dealer)


def test_a_req_peer_gets_its_reply_through_the_route_with_the_delimiter(sockets):
    router = sockets(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    req = sockets(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")
    send(req, MessageType.PING, {"t_ns": np.int64(5)})
    ping = recv(router, timeout_ms=5000)
    assert ping is not None and ping.meta == {"t_ns": 5}
    assert len(ping.route) == 2 and ping.route[1] == b""
    send(router, MessageType.PONG, ping.meta, route=ping.route)
    pong = recv(req, timeout_ms=5000)
    assert pong is not None and pong.type is MessageType.PONG


def test_recv_times_out_with_none_and_send_times_out_with_an_error(sockets):
    dealer = sockets(zmq.DEALER)
    dealer.setsockopt(zmq.SNDTIMEO, 50)  # no peer: nothing arrives, and a send has nowhere to go
    assert recv(dealer, timeout_ms=50) is None
    with pytest.raises(SendTimeoutError, match="PING timed out after SNDTIMEO 50 ms"):
        send(dealer, MessageType.PING)


def test_an_inbox_logs_counts_and_skips_a_malformed_message_and_reads_on(context, ipc_dir):
    """The one PULL-inbox loop every stage uses: a bad message never stops the next."""
    address = f"ipc://{ipc_dir}/inbox.sock"
    pull = open_socket(context, zmq.PULL, recv_hwm=8, bind=address)
    push = open_socket(context, zmq.PUSH, send_timeout_ms=5000, connect=address)
    try:
        assert pull.getsockopt(zmq.LINGER) == 0 and pull.getsockopt(zmq.SNDTIMEO) == 0
        assert pull.getsockopt(zmq.RCVHWM) == 8
        logged = []
        log = SimpleNamespace(error=lambda text, *args: logged.append(text % args))
        inbox = Inbox(pull, log, "a writer")
        send(push, MessageType.PING, {"n": 1})
        push.send_multipart([b"garbage"])
        send(push, MessageType.PING, {"n": 2})
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += [m.meta["n"] for m in inbox.read(10, wait_ms=100)]
        assert got == [1, 2]
        assert inbox.dropped == 1
        assert logged and "from a writer" in logged[0] and "truncated header" in logged[0]
        assert inbox.drain() == 0
    finally:
        push.close(0)
        pull.close(0)


def test_an_inbox_reads_through_the_receive_function_it_is_given(context, ipc_dir):
    """Completion's inbox reads with pipeline.transport.wire.forwarded.recv: an inbox given `receive`
    reads every message through it, and what that function refuses is counted and skipped."""
    address = f"ipc://{ipc_dir}/inbox.sock"
    pull = open_socket(context, zmq.PULL, bind=address)
    push = open_socket(context, zmq.PUSH, send_timeout_ms=5000, connect=address)
    calls = []

    def receive(socket, timeout_ms, *, limits):
        message = recv(socket, timeout_ms, limits=limits)
        if message is not None:
            calls.append(message.meta["n"])
            if message.meta["n"] == 2:
                raise WireError("the reader refuses n=2")
        return message

    try:
        log = SimpleNamespace(error=lambda text, *args: None)
        inbox = Inbox(pull, log, "dispatch", receive=receive)
        for n in (1, 2, 3):
            send(push, MessageType.PING, {"n": n})
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += [m.meta["n"] for m in inbox.read(10, wait_ms=100)]
        assert got == [1, 3] and calls == [1, 2, 3]
        assert inbox.dropped == 1
    finally:
        push.close(0)
        pull.close(0)
