"""Every decoder of what arrives over a port, fed hostile input: only WireError may come out.

`wire.decode` has its own property tests in test_wire.py; here: `wire.recv`
over real ROUTER sockets (routes, REQ delimiters, limits), lying headers on
otherwise valid messages, and the decoders that stages apply to a message's
arrays afterwards: `chunk_from_wire` (the front), `item_array` and the
dispatch state's use of hostile items (dispatch), `results_problem`
(completion), and the dispatch file's own reader.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import zmq
from conftest import fuzz_examples, make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.completion.intake import results_problem
from gpu.dispatch.batch import item_array
from gpu.dispatch.file_format import parse_header, read_leases
from gpu.dispatch.state import DispatchState
from gpu.work_protocol import ITEM_DTYPE
from ingest.chunk_wire import chunk_from_wire, chunk_to_wire
from ingest.input_chunk import InputChunk
from ingest.line_errors import LineError
from ingest.request_shape import parse_shape
from pipeline.core.errors import WireError
from pipeline.store.segment import Segment
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.transport import wire

MT = wire.MessageType
FUZZ = settings(
    max_examples=fuzz_examples(100),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
DTYPES = ["|u1", "<u4", "<i8", "<u8", "<f8", "|V3", ITEM_DTYPE, [("segment", "<u4")]]


@st.composite
def arrays(draw, max_len: int = 6) -> np.ndarray:
    """Any array the wire can carry: odd dtypes, 0-d, 2-d, extreme values."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.sampled_from([(), (0,), (1,), (2, 2), None]))
    if shape is None:
        shape = (draw(st.integers(0, max_len)),)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=size, max_size=size))
    return np.frombuffer(raw, dtype).reshape(shape)


def edge_ints(dtype: str, n: int) -> st.SearchStrategy:
    info = np.iinfo(dtype)
    value = st.sampled_from([0, 1, 2, info.max, info.min, info.max // 2 + 1]) | st.integers(-2, 9)
    value = value.filter(lambda v: info.min <= v <= info.max)
    return st.lists(value, min_size=n, max_size=n).map(lambda v: np.array(v, dtype))


# ---- wire.recv over real sockets -------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    """A ROUTER with a DEALER and a REQ peer over inproc, closed at the end."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://fuzz-recv")
    peers = {}
    for kind in (zmq.DEALER, zmq.REQ):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.REQ_RELAXED, 1) if kind == zmq.REQ else None
        sock.connect("inproc://fuzz-recv")
        peers[kind] = sock
    yield router, peers
    for sock in (router, *peers.values()):
        sock.close(0)
    ctx.term()


@FUZZ
@given(st.lists(st.binary(max_size=48), min_size=1, max_size=70), st.booleans())
def test_recv_of_random_frames_on_a_router_raises_only_wire_error_with_the_route(
    pair, frames, from_req
):
    router, peers = pair
    peers[zmq.REQ if from_req else zmq.DEALER].send_multipart(frames)
    limits = wire.WireLimits(max_frames=64, max_bytes=4096)
    route = 2 if from_req or frames[0] == b"" else 1  # identity (+ an empty delimiter)
    try:
        message = wire.recv(router, 2000, limits=limits)
    except WireError as exc:
        assert len(exc.route) == route  # the sender can still be answered
        return
    assert message is not None and len(message.route) == route


@st.composite
def lying_messages(draw) -> list[bytes]:
    """A valid message, then one lie: a length, a count, a dtype, a shape or a frame cut short."""
    items = np.zeros(draw(st.integers(0, 4)), ITEM_DTYPE)
    frames = [
        bytes(memoryview(f))
        for f in wire.encode(MT.HAND_BACK, {"session": "s", "reason": "r"}, {"items": items})
    ]
    magic, msg_type, flags, n_arrays, meta_bytes = wire.HEADER.unpack_from(frames[0])
    envelope = orjson.loads(frames[0][wire.HEADER.size :])
    lie = draw(
        st.sampled_from(["n_arrays", "meta_bytes", "dtype", "shape", "cut", "extra", "type"])
    )
    big = st.integers(0, 2**32 - 1)
    if lie == "n_arrays":
        n_arrays = draw(big.filter(lambda v: v != 1))
    elif lie == "meta_bytes":
        meta_bytes = draw(big.filter(lambda v: v != meta_bytes))
    elif lie == "dtype":
        envelope["arrays"][0][1] = draw(
            st.sampled_from(["<u4", "|V21", "|V0", "O", ">u8", "<U4", 5, [["a", "<u8"]] * 2])
        )
    elif lie == "shape":
        envelope["arrays"][0][2] = draw(
            st.lists(st.integers(-1, 2**63 - 1), max_size=9) | st.just("x")
        )
    elif lie == "cut":
        frames[1] = frames[1][: draw(st.integers(0, max(0, len(frames[1]) - 1)))] + (
            b"" if frames[1] else b"x"
        )
    elif lie == "extra":
        frames.append(draw(st.binary(max_size=8)))
    else:
        msg_type = draw(st.integers(0, 0xFFFF))
    body = orjson.dumps(envelope)
    if lie in ("dtype", "shape"):
        meta_bytes = len(body)
    return [wire.HEADER.pack(magic, msg_type, flags, n_arrays, meta_bytes) + body, *frames[1:]]


@FUZZ
@given(lying_messages())
def test_valid_headers_with_one_lie_raise_wire_error(frames):
    try:
        message = wire.decode(frames)
    except WireError:
        return
    # What decodes is self-consistent (a lie about the dtype of an empty array, or a type
    # whose required fields the meta happens to carry); dispatch then checks what items are.
    for array in message.arrays.values():
        array.tobytes()
    if message.type == MT.HAND_BACK:
        try:
            assert item_array(message, "items").dtype == ITEM_DTYPE
        except ValueError:
            refused = message.arrays["items"]
            assert refused.dtype != ITEM_DTYPE or refused.ndim != 1


# ---- the front: chunk_from_wire ------------------------------------------------------------------


def good_chunk() -> InputChunk:
    shapes = (parse_shape({}, "/v1/embeddings"), parse_shape({"max_tokens": 8}, "/v1/completions"))
    return InputChunk(
        index=2,
        first_line=21,
        last_line=30,
        line=np.array([21, 23, 24, 29], np.uint64),
        custom_ids=("a", "bb", "", "dddd"),
        models=("echo", "texty"),
        model_index=np.array([0, 1, 0, 1], np.int64),
        shapes=shapes,
        shape_index=np.array([0, 1, 0, 0], np.int64),
        tokens=np.arange(5, dtype=np.uint32),
        offsets=np.array([0, 2, 2, 5, 5], np.int64),
        text_items=np.array([1, 3], np.int64),
        texts=("hello", (("user", "hi"),)),
        errors=(LineError(22, None, "invalid_json", "bad"),),
    )


@FUZZ
@given(st.data())
def test_chunk_from_wire_of_lying_arrays_and_meta_raises_only_wire_error(data):
    meta, arrays_ = chunk_to_wire(good_chunk())
    meta = orjson.loads(orjson.dumps(meta))  # as the front receives it
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            name = data.draw(st.sampled_from(sorted(arrays_)))
            n = data.draw(st.integers(0, 6))
            arrays_[name] = data.draw(
                arrays() | edge_ints("<i8", n) | edge_ints("<u8", n) | edge_ints("<u4", n)
            )
        else:
            key = data.draw(st.sampled_from(sorted(meta)))
            meta[key] = data.draw(
                st.integers(-(2**63), 2**64 - 1)
                | st.sampled_from(
                    [None, "x", [], [{}], [{"endpoint": "/v1/completions", "top_p": 0}]]
                )
                | st.lists(
                    st.dictionaries(
                        st.sampled_from(["endpoint", "seed", "stop", "x"]),
                        st.integers(-1, 2) | st.text(max_size=3),
                    ),
                    max_size=2,
                )
            )
    try:
        chunk = chunk_from_wire(meta, arrays_)
    except WireError:
        return
    n = chunk.n_items  # what came through is consistent, so the front can index with it
    assert len(chunk.line) == len(chunk.model_index) == len(chunk.shape_index) == n
    assert chunk.offsets[0] == 0 and chunk.offsets[-1] == len(chunk.tokens)
    assert (np.diff(chunk.offsets) >= 0).all() and (np.diff(chunk.line.astype(np.int64)) > 0).all()
    if n:
        assert chunk.first_line <= int(chunk.line.min()) <= int(chunk.line.max()) <= chunk.last_line
        assert int(chunk.model_index.max()) < len(chunk.models)
        assert int(chunk.shape_index.max()) < len(chunk.shapes)


def test_chunk_from_wire_round_trips_and_refuses_wrapping_offsets():
    chunk = good_chunk()
    back = chunk_from_wire(*chunk_to_wire(chunk))
    assert back.custom_ids == chunk.custom_ids and back.shapes == chunk.shapes
    meta, arrays_ = chunk_to_wire(chunk)
    # Diffs of these wrap around in int64 and all look >= 0: offsets must be range-checked.
    arrays_["offsets"] = np.array([0, 2**63 - 1, -(2**63), -1, 5], np.int64)
    with pytest.raises(WireError, match="token offsets"):
        chunk_from_wire(meta, arrays_)
    meta, arrays_ = chunk_to_wire(chunk)
    arrays_["line"] = np.array([21, 23, 24, 31], np.uint64)  # line 31 is another chunk's
    with pytest.raises(WireError, match="line numbers"):
        chunk_from_wire(meta, arrays_)
    meta, arrays_ = chunk_to_wire(chunk)
    meta["shapes"][1]["max_tokens"] = "lots"  # dispatch would choke on it much later
    with pytest.raises(WireError, match="max_tokens"):
        chunk_from_wire(meta, arrays_)


# ---- dispatch: item arrays and what the state does with hostile items ---------------------------


@FUZZ
@given(arrays())
def test_item_array_accepts_only_flat_items(array):
    message = wire.decode(
        wire.encode(MT.REPORT, {"session": "s", "seen_batch": 0}, {"held": array})
    )
    try:
        items = item_array(message, "held")
    except ValueError:
        assert array.dtype != ITEM_DTYPE or array.ndim != 1
        return
    assert items.dtype == ITEM_DTYPE and items.ndim == 1


@pytest.fixture(scope="module")
def dispatch_state(tmp_path_factory):
    """A dispatch state over one real segment of 10 items, 4 of them out on lease."""
    root = tmp_path_factory.mktemp("segments")
    key = SegmentKey(KIND_INPUT, "m", 1, 64)
    seg = Segment.create(root, 1, key, slot_bytes_for(64 * 4), 1000)
    seg.append(*make_batch(np.random.default_rng(1), 10, 1))
    state = DispatchState(lease_s=10.0, max_attempts=3)
    state.add_segment(seg, 0, seg.entries)
    state.loaded()
    batch = state.next_batch("honest", "m", 4, 10_000, now=0.0)
    yield state, seg, batch
    seg.close()


hostile_items = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 2, 2**64 - 1]),
        st.sampled_from([0, 3, 9, 10, 999, 1000, 2**32 - 1]),
        st.sampled_from([0, 1, 4, 11, 2**64 - 1]),
    ),
    max_size=6,
).map(lambda rows: np.array(rows, ITEM_DTYPE))


@FUZZ
@given(hostile_items, st.sampled_from(["adopt", "report", "hand_back"]))
def test_hostile_items_never_break_the_dispatch_state_or_take_a_lease(dispatch_state, items, op):
    state, seg, honest = dispatch_state
    before = [b.items.tobytes() for b in state.leases("honest")]
    if op == "adopt":
        known = state.adopt("hostile", items, now=1.0)
        assert set(known.tolist()) <= {0, 1, 2}
    elif op == "report":
        state.report("hostile", items, 2**64 - 1, now=1.0)
    else:
        for batch in state.leases("hostile"):
            state.reclaim(batch.batch_id, count_attempt=False, slots=items["slot"].astype(np.int64))
    assert [b.items.tobytes() for b in state.leases("honest")] == before
    for batch in state.leases("hostile"):  # only real, live, unleased slots can be adopted
        assert (batch.items["slot"] < seg.entries).all()
        assert not np.isin(batch.items["slot"], honest.items["slot"]).any()
    state.drop_session_quietly("hostile")


# ---- completion: RESULTS arrays ---------------------------------------------------------------------


def good_results(n: int = 3) -> dict[str, np.ndarray]:
    return {
        "items": np.zeros(n, ITEM_DTYPE),
        "status": np.zeros(n, np.uint8),
        "kind": np.zeros(n, np.uint8),
        "prompt_tokens": np.zeros(n, np.uint32),
        "payload": np.zeros(6, np.uint8),
        "offsets": np.arange(n + 1, dtype=np.int64) * 2,
    }


@FUZZ
@given(st.data())
def test_results_problem_never_raises_and_what_it_passes_is_in_bounds(data):
    results = good_results()
    for _ in range(data.draw(st.integers(1, 2))):
        name = data.draw(st.sampled_from(sorted(results)))
        n = data.draw(st.integers(0, 5))
        results[name] = data.draw(arrays() | edge_ints("<i8", n) | edge_ints("<u8", n))
    if data.draw(st.booleans()):
        del results[data.draw(st.sampled_from(sorted(results)))]
    problem = results_problem(results)
    if problem is not None:
        assert isinstance(problem, str)
        return
    n, offsets = len(results["items"]), results["offsets"].astype(np.int64)
    assert all(results[k].ndim == 1 for k in results) and len(offsets) == n + 1
    assert offsets[0] == 0 and (np.diff(offsets) >= 0).all()
    assert offsets[-1] <= len(results["payload"])


def test_results_problem_names_unsigned_offsets_that_go_back():
    results = good_results()
    results["offsets"] = np.array([0, 6, 2, 6], np.uint64)  # np.diff of u8 never looks < 0
    assert results_problem(results) == "offsets decrease"
    assert results_problem(good_results()) is None


# ---- the dispatch file's reader --------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300))
def test_the_dispatch_file_reader_takes_any_bytes(data):
    assert parse_header(data) is None or len(data) >= 64
    leases, good_end = read_leases(bytes(64) + data)
    assert isinstance(leases, list) and good_end <= 64 + len(data)
