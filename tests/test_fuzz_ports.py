"""Hostile input on every port one real broker binds: it logs, drops, answers, and keeps serving.

One broker (an echo worker, small message limits) takes a seed job, then a
barrage on the ingest front, dispatch, heartbeat and completion ports from raw
DEALER and REQ sockets: random frames, truncated and lying headers, many
frames, frames over the limit, every message type with wrong fields, item
arrays with wrong dtypes and out-of-range segments and slots, RESULTS for
items never dispatched, FETCH and CANCEL for unknown or path-like jobs.
After each barrage no stage has restarted (the supervisor's report), each port
still answers, and a normal job runs with every line's result exactly once; at
the end `run.py check` finds nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import zmq
from broker import Broker, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import fuzz_examples, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu.work_protocol import ITEM_DTYPE
from pipeline.core import exitcodes
from pipeline.transport import wire
from pipeline.transport.wire import HEADER, MAGIC

MT = wire.MessageType
PORTS = ("ingest", "dispatch", "heartbeat", "completion", "vectors")
SESSION = "f00dfeedf00dfeed"  # a hostile "worker" whose identity is its session, as dispatch asks
LIMITS = """max_message_bytes = 1048576
"""
DISPATCH = """lease_s = 6.0
session_timeout_s = 2.0
reregister_grace_s = 0.5
report_s = 0.3
max_message_bytes = 1048576"""
FUZZ = settings(
    max_examples=fuzz_examples(80),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def cli(config: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`run.py ARGS --config CONFIG`, run in this process (tests/client_commands.py)."""
    return run_cli(*args, "--config", str(config))


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    config = write_config(tmp, workers=1, dispatch=DISPATCH)
    text = config.read_text().replace("[ingest]\n", f"[ingest]\n{LIMITS}", 1)
    text = text.replace("[completion]\n", "[completion]\nmax_message_bytes = 65536\n", 1)
    config.write_text(text)
    b = Broker(config)
    try:
        b.start()
        data = tmp / "seed.jsonl"
        write_jsonl(data, 40)
        result = submit(config, data, "--job-id", "seed")
        assert result.returncode == 0, result.stderr
        b.seed_pids = b.pids()
        b.tmp = tmp
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def peers(broker, context):
    """One DEALER per port (dispatch's named after SESSION), all closed at the end."""
    made: list[zmq.Socket] = []

    def make(port: str, kind: int = zmq.DEALER, identity: bytes | None = None) -> zmq.Socket:
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address(broker, port))
        made.append(sock)
        return sock

    ports = {port: make(port) for port in PORTS}
    ports["worker"] = make("dispatch", identity=SESSION.encode())
    ports["make"] = make
    yield ports
    for sock in made:
        sock.close(0)


def address(b: Broker, port: str) -> str:
    s = b.settings
    return {
        "ingest": s.ingest.bind,
        "dispatch": s.dispatch.bind,
        "heartbeat": s.dispatch.heartbeat_bind,
        "completion": s.completion.bind,
        "vectors": s.vectors.bind,
    }[port]


def drain(sock: zmq.Socket) -> list[list[bytes]]:
    """Whatever answers are waiting (so no receive queue fills up)."""
    got = []
    while sock.poll(0):
        got.append(sock.recv_multipart())
    return got


def ask(sock: zmq.Socket, msg_type: MT, meta: dict, arrays: dict | None = None, want=None):
    """Send one well-formed message; the first answer (of type `want`, if given) or None."""
    drain(sock)
    wire.send(sock, msg_type, meta, arrays)
    deadline = time.monotonic() + 5.0
    while (left := deadline - time.monotonic()) > 0:
        answer = wire.recv(sock, int(left * 1000) + 1)
        if answer is None or want is None or answer.type == want:
            return answer
    return None


def alive(b: Broker, peers) -> None:
    """Each port answers a fresh, polite peer; no stage has restarted."""
    make = peers["make"]
    checks = [
        ("ingest", MT.HELLO, {}, MT.CATALOG),
        ("dispatch", MT.PING, {}, MT.PONG),
        ("heartbeat", MT.PING, {}, MT.PONG),
        ("completion", MT.PING, {}, MT.PONG),
        ("vectors", MT.PING, {}, MT.PONG),
    ]
    for port, msg_type, meta, want in checks:
        sock = make(port)
        answer = ask(sock, msg_type, meta, want=want)
        assert answer is not None and answer.type == want, f"{port} port stopped answering"
        sock.close(0)
    assert b.pids() == b.seed_pids, "a stage was restarted"
    assert not any(b.restarts().values()), b.report()["deaths"]
    assert b.report()["deaths"] == []


def still_serves(b: Broker, peers, job_id: str, lines: int = 20) -> None:
    """After a barrage: every port answers, no stage restarted, and a normal job runs with
    each line's result exactly once."""
    alive(b, peers)
    data = b.tmp / f"{job_id}.jsonl"
    write_jsonl(data, lines, seed=len(job_id))
    result = submit(b.config, data, "--job-id", job_id)
    assert result.returncode == 0, result.stderr
    out = b.tmp / f"{job_id}.out.jsonl"
    fetched = cli(b.config, "results", job_id, "-o", str(out), "--follow")
    assert fetched.returncode == 0, fetched.stderr
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(lines))  # each exactly once
    alive(b, peers)


def frame0(msg_type: int, envelope: object, n_arrays: int = 0, meta_bytes: int | None = None):
    body = envelope if isinstance(envelope, bytes) else orjson.dumps(envelope)
    size = len(body) if meta_bytes is None else meta_bytes
    return HEADER.pack(MAGIC, msg_type, 0, n_arrays, size) + body


def items(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(list(rows), ITEM_DTYPE)


def seed_segment(b: Broker) -> int:
    return int(next(iter(sorted(b.data_dir.segments.glob("in-*.seg")))).name[3:15])


# ---- random bytes and plausible envelopes on every port ---------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
msg_types = st.sampled_from([int(t) for t in MT]) | st.integers(0, 0xFFFF)


def test_random_frames(broker, peers):
    @FUZZ
    @given(st.sampled_from(PORTS), st.lists(st.binary(max_size=64), min_size=1, max_size=6))
    def barrage(port, frames):
        peers[port].send_multipart(frames)
        drain(peers[port])

    barrage()
    still_serves(broker, peers, "after-random-frames")


def test_plausible_headers_with_lying_lengths(broker, peers):
    plausible_headers_with_lying_lengths(peers)
    still_serves(broker, peers, "after-lying-lengths")


@FUZZ
@given(st.sampled_from(PORTS), st.data())
def plausible_headers_with_lying_lengths(peers, port, data):
    msg_type = data.draw(msg_types)
    meta = data.draw(
        st.dictionaries(st.sampled_from(["job", "session", "chunk", "model"]), json_values)
    )
    arrays = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(["items", "held", "x"]),
                st.sampled_from(["<u4", "|u1", "<f8"]),
                st.lists(st.integers(-2, 9), max_size=2),
            ).map(list),
            max_size=2,
        )
    )
    n_arrays = data.draw(st.just(len(arrays)) | st.integers(0, 2**32 - 1))
    body = orjson.dumps({"meta": meta, "arrays": arrays})
    meta_bytes = data.draw(st.just(len(body)) | st.integers(0, 2**32 - 1))
    bodies = data.draw(st.lists(st.binary(max_size=40), min_size=len(arrays), max_size=len(arrays)))
    frames = [frame0(msg_type, body, n_arrays, meta_bytes), *bodies]
    cut = data.draw(st.integers(0, len(frames[0])))
    if data.draw(st.booleans()):  # truncated
        frames[0] = frames[0][:cut]
    peers[port].send_multipart(frames)
    drain(peers[port])


def test_every_type_with_wrong_fields_at_dispatch_as_a_registered_looking_worker(broker, peers):
    """Valid frames, real message types, and meta or arrays of the wrong kind."""
    every_type_with_wrong_fields(peers)
    still_serves(broker, peers, "after-wrong-fields")


@FUZZ
@given(st.data())
def every_type_with_wrong_fields(peers, data):
    msg_type = data.draw(st.sampled_from(list(MT)))
    meta = {
        "session": SESSION,
        **data.draw(
            st.dictionaries(
                st.sampled_from(
                    [
                        "model",
                        "max_items",
                        "max_tokens",
                        "seen_batch",
                        "queued",
                        "result_id",
                        "batch_id",
                        "reason",
                        "count_attempt",
                        "epoch",
                    ]
                ),
                json_values,
                max_size=6,
            )
        ),
    }
    name = data.draw(st.sampled_from(["held", "items", "status", "offsets", "payload"]))
    dtype = data.draw(st.sampled_from(["<u4", "|u1", "<i8", "<f8", ITEM_DTYPE]))
    shape = data.draw(st.lists(st.integers(0, 4), max_size=2))
    array = np.zeros(shape, dtype)
    if dtype is ITEM_DTYPE:
        array["segment"] = data.draw(st.integers(0, 2**64 - 1))
        array["slot"] = data.draw(st.integers(0, 2**32 - 1))
    try:
        frames = wire.encode(msg_type, meta, {name: array})
    except wire.WireError:  # the required fields are missing: send it anyway
        body = orjson.dumps(
            {"meta": meta, "arrays": [[name, wire.dtype_to_wire(array.dtype), shape]]}
        )
        frames = [frame0(msg_type, body, 1), array.tobytes()]
    peers["worker"].send_multipart(frames, copy=True)
    drain(peers["worker"])


# ---- crafted messages, port by port ----------------------------------------------------------


def test_huge_frame_counts_and_frames_over_the_limit(broker, peers):
    make = peers["make"]
    for port in PORTS:
        many = make(port)
        many.send_multipart([frame0(MT.PING, {"meta": {}, "arrays": []}, 4999)] + [b""] * 4999)
        big = make(port)
        big.send_multipart([frame0(MT.PING, {"meta": {}, "arrays": []}, 1), bytes(2 << 20)])
    alive(broker, peers)


def test_the_front_refuses_lying_chunks(broker, peers):
    front = peers["ingest"]
    good = {
        "line": np.arange(1, 3, dtype="<u8"),
        "ids": np.frombuffer(b"ab", np.uint8),
        "ids_offsets": np.array([0, 1, 2], "<i8"),
        "model_index": np.zeros(2, "<u4"),
        "shape_index": np.zeros(2, "<u4"),
        "tokens": np.arange(4, dtype="<u4"),
        "offsets": np.array([0, 2, 4], "<i8"),
        "text_items": np.zeros(0, "<i8"),
        "texts": np.frombuffer(b"[]", np.uint8),
        "errors": np.frombuffer(b"[]", np.uint8),
    }
    meta = {
        "job": "evil",
        "chunk": 0,
        "chunk_lines": 2,
        "index": 0,
        "first_line": 1,
        "last_line": 2,
        "models": ["echo"],
        "shapes": [{"endpoint": "/v1/embeddings"}],
    }
    lies = [
        {"offsets": np.array([0, 2**62, 4], "<i8")},
        {"offsets": np.array([0, 2**63 - 1, -(2**63), 4], "<i8")},  # wraps in np.diff
        {"ids_offsets": np.array([0, 2**63 - 1, -(2**63), -1, 2], "<i8")},
        {"model_index": np.array([0, 2**31], "<u4")},
        {"shape_index": np.array([7, 0], "<u4")},
        {"text_items": np.array([5], "<i8"), "texts": np.frombuffer(b'["x"]', np.uint8)},
        {"texts": np.frombuffer(b'{"a": 1}', np.uint8)},
        {"errors": np.frombuffer(b"[[1, 2]]", np.uint8)},
        {"line": np.zeros((2, 2), "<u8")},
        {"tokens": np.zeros(4, "<f8")},
        {"offsets": np.zeros(3, "<f8") + np.nan},
        {"model_index": np.zeros(2, ITEM_DTYPE)},
    ]
    for lie in lies:
        answer = ask(front, MT.SUBMIT_CHUNK, meta, {**good, **lie}, want=MT.CHUNK_ERROR)
        assert answer is not None and answer.type == MT.CHUNK_ERROR, lie
    for job in ("../../etc", "/etc/passwd", "", "x" * 200, "a/b"):
        answer = ask(front, MT.SUBMIT_CHUNK, {**meta, "job": job}, good, want=MT.CHUNK_ERROR)
        assert answer is not None and "not allowed" in answer.meta["reason"], job
        answer = ask(front, MT.JOB_STATUS, {"job": job}, want=MT.JOB_INFO)
        assert answer is not None and answer.meta["exists"] is False, job
    answer = ask(front, MT.PING, {})
    assert answer is not None and answer.type == MT.ERROR
    alive(broker, peers)


def test_dispatch_drops_items_it_never_gave_out(broker, peers):
    worker = peers["worker"]
    seg = seed_segment(broker)
    hostile = items((seg, 2**32 - 1, 1), (seg, 10**9, 2), (2**64 - 1, 0, 0), (seg, 0, 12345))
    hello = ask(
        worker,
        MT.WORKER_HELLO,
        {"session": SESSION, "model": "echo"},
        {"held": hostile},
        want=MT.WELCOME,
    )
    assert hello is not None and hello.arrays["known"].tolist() == [0, 0, 0, 0]
    for arrays in (
        {"held": hostile},
        {"held": np.zeros(3, "<u4")},
        {"held": np.zeros((2, 2), ITEM_DTYPE)},
        {"held": np.zeros(3, [("segment", "<u4")])},
    ):
        wire.send(
            worker,
            MT.REPORT,
            {"session": SESSION, "seen_batch": 2**64 - 1, "queued": [1, [2], "x"]},
            arrays,
        )
        wire.send(
            worker,
            MT.HAND_BACK,
            {"session": SESSION, "reason": "x", "count_attempt": True},
            {"items": arrays["held"]},
        )
        wire.send(worker, MT.WORKER_HELLO, {"session": SESSION, "model": "echo"}, arrays)
    for batch_id in (0, 1, 2**64 - 1):
        results = {
            "items": hostile,
            "status": np.zeros(4, "u1"),
            "kind": np.zeros(4, "u1"),
            "prompt_tokens": np.zeros(4, "<u4"),
            "payload": np.zeros(8, "u1"),
            "offsets": np.array([0, 2, 4, 6, 8], "<i8"),
        }
        wire.send(
            worker,
            MT.RESULTS,
            {"session": SESSION, "result_id": batch_id, "batch_id": batch_id},
            results,
        )
        for lie in (
            {"offsets": np.array([0, 9, 4, 6, 2**40], "<i8")},
            {"items": np.zeros(4, "<u8")},
            {"status": np.zeros((4, 3), "u1")},
            {"payload": np.zeros((8, 2), "u1")},
            {"offsets": np.zeros(5, ITEM_DTYPE)},
        ):
            wire.send(worker, MT.RESULTS, {"session": SESSION, "result_id": 7}, {**results, **lie})
    big = ask(
        worker,
        MT.WORK_REQUEST,
        {"session": SESSION, "model": "echo", "max_items": 2**64 - 1, "max_tokens": 2**64 - 1},
        want=MT.NO_WORK,
    )
    assert big is not None
    for _ in range(2000):  # many requests from one session park one of them, not 2000
        wire.send(
            worker,
            MT.WORK_REQUEST,
            {"session": SESSION, "model": "nope", "max_items": 1, "max_tokens": 1},
        )
    wire.send(worker, MT.BYE, {"session": SESSION})
    alive(broker, peers)
    answer = ask(peers["dispatch"], MT.REPORT, {"session": "someone-else", "seen_batch": 0})
    assert answer is not None and answer.type == MT.ERROR  # identity is not the session


def test_completion_answers_unknown_and_path_like_jobs_with_errors(broker, peers):
    client = peers["completion"]
    for job in ("nope", "../jobs/seed", "/etc", ".", "", "seed/../seed"):
        for msg_type in (MT.FETCH, MT.JOB_STATUS, MT.CANCEL):
            answer = ask(client, msg_type, {"job": job})
            assert answer is not None and answer.type == MT.ERROR, (job, msg_type)
    for meta in (
        {"limit": "x"},
        {"limit": -5},
        {"all": True, "cursors": [[1]]},
        {"all": True, "cursors": [["a", "b"]]},
        {"all": True, "cursors": 5},
        {"ack": [1]},
        {"limit": 2**63},
    ):
        answer = ask(client, MT.FETCH, {"job": "seed", **meta})
        assert answer is not None and answer.type in (MT.ERROR, MT.RESULT_PAGE), meta
    info = ask(client, MT.JOB_STATUS, {"job": "seed"}, want=MT.JOB_INFO)
    assert info is not None and info.meta["total"] == 40
    req = peers["make"]("completion", zmq.REQ)
    answer = ask(req, MT.SUBMIT_CHUNK, {"job": "seed", "chunk": 0})
    assert answer is not None and answer.type == MT.ERROR
    alive(broker, peers)


def test_after_the_barrage_a_job_round_trips_and_the_data_dir_checks_clean(broker, peers):
    alive(broker, peers)
    data = broker.tmp / "after.jsonl"
    write_jsonl(data, 30, seed=3)
    result = submit(broker.config, data, "--job-id", "after")
    assert result.returncode == 0, result.stderr
    out = broker.tmp / "after.out.jsonl"
    fetched = cli(broker.config, "results", "after", "-o", str(out), "--follow")
    assert fetched.returncode == 0, fetched.stderr
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(30))
    seed_out = broker.tmp / "seed.out.jsonl"
    assert cli(broker.config, "results", "seed", "-o", str(seed_out), "--follow").returncode == 0
    assert len(seed_out.read_text().splitlines()) == 40
    logs = "".join(p.read_text() for p in broker.data_dir.log.glob("*.log"))
    assert "Traceback" not in logs  # no exception escaped to a log, caught or not
    assert broker.pids() == broker.seed_pids
    assert broker.stop() == exitcodes.OK, broker.stderr
    check = cli(broker.config, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    wait_for(lambda: broker.proc.poll() is not None, "the broker to exit")
