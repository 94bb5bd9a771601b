"""Work tokens: results and claims are taken only for work this data dir handed out.

Real brokers (`run.py --config`) and a real `run.py worker` doing the honest
work; the attackers are raw DEALERs in this test process that speak the
wire protocol and know every (segment, slot, seq) they need (read from the
segment files, the best any guesser can do). One test per way in:
results from a process that never registered (or with a made-up token), a
re-registration that claims queued items it was never handed, and a worker
that survives its data dir being removed and made again (SIGKILLed broker).
Each ends with the job completed within a bound from the honest worker's
results only, and the project's consistency check.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
import zygote
from broker import REPO, Broker, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from collector.results_client import DispatchClient
from gpu.dispatch.work_token import SECRET_FILE, WorkTokens
from gpu.engines.base import EngineResult
from gpu.work_protocol import ITEM_DTYPE
from gpu.worker.options import WorkerOptions
from gpu.worker.results import results_message
from pipeline.core import exitcodes, item_seq
from pipeline.core.errors import FabricError
from pipeline.store.segment import Segment
from pipeline.transport import wire

MT = wire.MessageType
FAST = "lease_s = 6.0\nsession_timeout_s = 1.5\nreregister_grace_s = 0.5\nreport_s = 0.3"
PROMPT_TOKENS = 10  # every prompt this long: one lane, so both lives of a data dir lay out alike
LANE = 64
FORGED = 999.0
JOB_S = 90  # the bound on finishing a job once the honest worker runs


@pytest.fixture
def peers():
    """Make raw worker-side peers of a broker; their sockets and context closed at the end."""
    context = zmq.Context()
    made: list[Peer] = []

    def make(b: Broker) -> Peer:
        made.append(Peer(context, b))
        return made[-1]

    yield make
    for p in made:
        p.socket.close(0)
    context.term()


@pytest.fixture
def honest(tmp_path):
    """Start `run.py worker` processes (echo engine) against a broker; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(b: Broker) -> subprocess.Popen:
        s = b.settings
        proc = zygote.Popen(
            [
                *(sys.executable, str(REPO / "run.py"), "worker"),
                *WorkerOptions(
                    broker=s.dispatch.bind,
                    model="echo",
                    heartbeat=s.dispatch.heartbeat_bind,
                    engine="echo",
                    target_batch_s=0,
                    drain_s=5,
                ).argv(),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def start_broker(tmp_path: Path) -> Broker:
    return Broker(write_config(tmp_path, workers=0, dispatch=FAST)).start()


def submit_prompts(b: Broker, tmp_path: Path, job: str, n: int, first_token: int) -> np.ndarray:
    """Submit n embedding requests for `echo`, each PROMPT_TOKENS tokens; returns the prompts."""
    prompts = first_token + np.arange(n * PROMPT_TOKENS).reshape(n, PROMPT_TOKENS)
    path = tmp_path / f"{job}.jsonl"
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": prompts[i].tolist()},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = submit(b.config, path, "--job-id", job)
    assert done.returncode == 0, done.stderr
    return prompts


def stored_items(b: Broker) -> np.ndarray:
    """(segment, slot, seq) of every written input slot: what a perfect guesser knows."""
    parts = []
    for path in sorted(b.data_dir.segments.glob("in-*.seg")):
        with Segment.open(path) as seg:
            slots = np.flatnonzero(seg.states())
            part = np.zeros(len(slots), ITEM_DTYPE)
            part["segment"], part["slot"] = seg.segment_id, slots
            part["seq"] = seg.slots["seq"][slots]
            parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, ITEM_DTYPE)


def wait_stored(b: Broker, n: int) -> np.ndarray:
    """The stored items once all n of them are written."""
    found: list[np.ndarray] = []

    def written() -> bool:
        found[:] = [stored_items(b)]
        return len(found[0]) == n

    wait_for(written, f"{n} stored items")
    return found[0]


def embeddings(items: np.ndarray, vectors: np.ndarray) -> dict[str, np.ndarray]:
    """RESULTS arrays, as the worker SDK makes them, for `vectors` (one row per item)."""
    lengths = np.full(len(items), PROMPT_TOKENS, np.uint32)
    result = EngineResult([None] * len(items), embeddings=vectors.astype(np.float32))
    return results_message(items, lengths, result)


class Peer:
    """A raw worker-side DEALER whose identity is its session, as dispatch requires."""

    def __init__(self, context: zmq.Context, b: Broker) -> None:
        self.session = secrets.token_hex(8)
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.session.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 2000)
        self.socket.connect(b.settings.dispatch.bind)

    def send(self, kind: MT, meta: dict, arrays: dict | None = None) -> None:
        wire.send(self.socket, kind, {"session": self.session, **meta}, arrays)

    def answer(self, *kinds: MT, timeout_s: float = 10.0) -> wire.Message:
        """The next message of one of `kinds` (others skipped); fails after `timeout_s`."""

        def got():
            message = wire.recv(self.socket, 50)
            return message if message is not None and message.type in kinds else None

        return wait_for(got, f"{[k.name for k in kinds]} from dispatch", timeout_s=timeout_s)

    def hello(self, held: np.ndarray, proofs: list, issued: np.ndarray) -> np.ndarray:
        """Register, claiming `held`; returns dispatch's answer per item (WELCOME known)."""
        meta = {"model": "echo", "epoch": 0, "tokens": proofs}
        self.send(MT.WORKER_HELLO, meta, {"held": held, "issued": issued})
        return np.array(self.answer(MT.WELCOME).arrays["known"])


def status(b: Broker) -> dict:
    with DispatchClient(b.settings.dispatch.bind, timeout_s=5.0) as client:
        return client.broker_status()


def job_state(b: Broker, job: str) -> str:
    return b.job_status(job)["state"]


def fetched_vectors(b: Broker, job: str, out: Path) -> dict[str, list[float]]:
    """custom_id -> embedding of every result line; asserts no error lines and none twice."""
    got = run_cli("results", job, "-o", str(out), "--config", str(b.config))
    assert got.returncode == 0, got.stderr
    errors = Path(f"{out}.errors.jsonl")
    assert not errors.exists() or not errors.read_text().strip(), errors.read_text()
    vectors: dict[str, list[float]] = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        assert record["custom_id"] not in vectors, f"{record['custom_id']} delivered twice"
        vectors[record["custom_id"]] = record["response"]["body"]["data"][0]["embedding"]
    return vectors


def assert_honest(vectors: dict[str, list[float]], prompts: np.ndarray) -> None:
    """Every item's embedding is the echo of its own prompt (the honest worker's), none forged."""
    assert sorted(vectors) == sorted(f"r{i}" for i in range(len(prompts)))
    for i, prompt in enumerate(prompts):
        got = np.asarray(vectors[f"r{i}"])
        assert got[:PROMPT_TOKENS].tolist() == prompt.astype(float).tolist(), (
            f"r{i} holds {got[:4].tolist()}..., not the echo of its prompt {prompt[:4].tolist()}"
        )


def stop_and_check(b: Broker) -> None:
    assert b.stop() == exitcodes.OK, b.stderr
    assert_check_clean(b.data_dir)


def test_results_from_a_process_that_never_registered_or_without_a_token_are_refused(
    tmp_path, peers, honest
):
    b = start_broker(tmp_path)
    try:
        prompts = submit_prompts(b, tmp_path, "j", 40, first_token=100)
        items = wait_stored(b, 40)
        forged = embeddings(items, np.full((len(items), LANE), FORGED))
        stranger = peers(b)  # never registers
        stranger.send(MT.RESULTS, {"result_id": 1, "batch_id": 1, "token": "0" * 32}, forged)
        guesser = peers(b)  # registers, then makes a token up
        assert guesser.hello(np.zeros(0, ITEM_DTYPE), [], np.zeros(0, ITEM_DTYPE)).size == 0
        made_up = {"result_id": 1, "batch_id": 7, "token": secrets.token_hex(16)}
        guesser.send(MT.RESULTS, made_up, {**forged, "issued": items})
        answers = [
            stranger.answer(MT.UNKNOWN_SESSION, MT.RESULTS_ACK).type,
            guesser.answer(MT.RESULTS_REFUSED, MT.RESULTS_ACK).type,
        ]
        honest(b)
        wait_for(lambda: job_state(b, "j") == "completed", "job j to complete", timeout_s=JOB_S)
        assert_honest(fetched_vectors(b, "j", tmp_path / "out.jsonl"), prompts)
        assert answers == [MT.UNKNOWN_SESSION, MT.RESULTS_REFUSED]
        assert status(b)["refused"]["results"] >= 2
        stop_and_check(b)
    finally:
        b.close()


def test_sessions_claiming_queued_items_they_were_never_handed_get_no_leases(
    tmp_path, peers, honest
):
    b = start_broker(tmp_path)
    try:
        prompts = submit_prompts(b, tmp_path, "j", 30, first_token=500)
        items = wait_stored(b, 30)
        max_attempts = b.settings.dispatch.max_attempts
        answers = []
        for _ in range(max_attempts + 1):  # each claims every queued item, then goes silent
            claimer = peers(b)
            proofs = [[1, secrets.token_hex(16), len(items)]]
            answers.append(claimer.hello(items, proofs, items).tolist())
            wait_for(
                lambda s=claimer.session: all(w["session"] != s for w in status(b)["workers"]),
                "the silent claimer's session to be dropped",
                timeout_s=20,
            )
        info = status(b)
        assert info["dead_lettered"] == 0 and info["in_flight"] == 0
        assert answers == [[0] * len(items)] * (max_attempts + 1), "claims were leased"
        assert info["refused"]["claims"] >= max_attempts + 1
        honest(b)
        wait_for(lambda: job_state(b, "j") == "completed", "job j to complete", timeout_s=JOB_S)
        assert_honest(fetched_vectors(b, "j", tmp_path / "out.jsonl"), prompts)
        stop_and_check(b)
    finally:
        b.close()


def test_a_worker_that_survives_its_data_dir_being_made_again_is_refused(tmp_path, peers, honest):
    first = start_broker(tmp_path)
    try:
        old_prompts = submit_prompts(first, tmp_path, "old", 20, first_token=100)
        survivor = peers(first)
        survivor.hello(np.zeros(0, ITEM_DTYPE), [], np.zeros(0, ITEM_DTYPE))

        def work():
            survivor.send(MT.WORK_REQUEST, {"model": "echo", "max_items": 64, "max_tokens": 10**6})
            got = survivor.answer(MT.WORK, MT.NO_WORK)
            return got if got.type == MT.WORK else None

        batch = wait_for(work, "a batch of the old job")
        token, batch_id = batch.meta.get("token", ""), batch.meta["batch_id"]
        held = np.array(batch.arrays["items"])
        mine = old_prompts[item_seq.index_of(held["seq"])]  # what it computed
        computed = embeddings(held, np.pad(mine, ((0, 0), (0, LANE - PROMPT_TOKENS))))
        first.kill()  # SIGKILL: every stage dies with the supervisor
    finally:
        first.close()
    secret_path = first.data_dir.root / SECRET_FILE
    secret = secret_path.read_bytes() if secret_path.exists() else b""
    shutil.rmtree(first.data_dir.root)
    second = Broker(first.config).start()  # a new data dir at the same path, the same ports
    try:
        prompts = submit_prompts(second, tmp_path, "new", 20, first_token=5000)
        items = wait_stored(second, 20)
        assert np.isin(held.view("V20"), items.view("V20")).all()  # the same (segment, slot, seq)
        proofs = [[batch_id, token, len(held)]]
        known = survivor.hello(held, proofs, held)
        meta = {"result_id": 1, "batch_id": batch_id, "token": token}
        survivor.send(MT.RESULTS, meta, {**computed, "issued": held})
        answer = survivor.answer(MT.RESULTS_REFUSED, MT.RESULTS_ACK)
        honest(second)
        wait_for(lambda: job_state(second, "new") == "completed", "job new", timeout_s=JOB_S)
        assert_honest(fetched_vectors(second, "new", tmp_path / "out.jsonl"), prompts)
        assert known.tolist() == [0] * len(held), "the old data dir's claims were leased"
        assert answer.type == MT.RESULTS_REFUSED
        assert secret and secret_path.read_bytes() != secret  # a new data dir, a new secret
        assert status(second)["refused"] == {"results": 1, "claims": 1}
        stop_and_check(second)
    finally:
        second.close()


def test_the_secret_is_made_once_owner_only_and_never_replaced(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    tokens = WorkTokens.of_data_dir(root)
    path = root / SECRET_FILE
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    items = np.zeros(3, ITEM_DTYPE)
    items["segment"], items["slot"], items["seq"] = 2, [4, 5, 6], item_seq.seq_of(1, np.arange(3))
    token = tokens.token(9, "s1", items)
    again = WorkTokens.of_data_dir(root)  # read back, not made anew
    assert again.verify(9, "s1", token, items)
    for batch_id, session, changed in ((10, "s1", items), (9, "s2", items), (9, "s1", items[:2])):
        assert not again.verify(batch_id, session, token, changed)
    inside, failed = again.covered("s1", [[9, token, 3]], items, items[[2, 0]])
    assert inside.tolist() == [True, True] and failed == 0
    moved = items.copy()
    moved["slot"][1] = 9  # the right seq in another slot is not an item of the batch
    assert again.covered("s1", [[9, token, 3]], items, moved)[0].tolist() == [True, False, True]
    assert again.covered("s1", [[9, token, 2]], items, items)[1] == 1  # a token over fewer
    path.write_text("not hex\n")
    with pytest.raises(FabricError, match="remove it and restart"):
        WorkTokens.of_data_dir(root)
    assert path.read_text() == "not hex\n"  # never silently replaced
    assert not [p for p in os.listdir(root) if p.endswith(".tmp")]
