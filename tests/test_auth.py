"""CURVE authentication on every port of a real broker, the exposure rule, owner-only files.

One broker runs with a server key (keys made by `run.py keys new`) and an
authorized_keys directory holding one client key. An authorized producer,
remote worker and results client do a job end to end; a local worker and the
vector sink (the broker's own key) deliver a job to the vector store. Raw
DEALERs with no key and with a key nobody authorized get no answer on any
port, nothing is stored for them, and no stage restarts. A broker without
keys refuses to bind beyond loopback unless allow_insecure is set.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zygote
from broker import REPO, Broker, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from config import load_settings
from config.settings import SecuritySettings
from gpu.work_protocol import ITEM_DTYPE
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError
from pipeline.transport import wire
from pipeline.transport.security import ClientCurve, client_curve, read_key_pair, read_public_key

MT = wire.MessageType
INTRUDER_SESSION = "badc0ffeebadc0ff"
FAST = "lease_s = 6.0\nsession_timeout_s = 2.0\nreregister_grace_s = 0.5\nreport_s = 0.3"
SIM_WORKER = 'model = "sim"\nsimulated_tokens_per_s = 5e6\nbatch_items = 64\ntarget_batch_s = 0'
REFUSED_WAIT_S = 1.5  # a port that lets a client in answers a PING within milliseconds


def run_py(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`run.py ARGS`, run in this process (tests/client_commands.py)."""
    return run_cli(*args)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """broker, producer and intruder key pairs; only producer.key is authorized."""
    root = tmp_path_factory.mktemp("keys")
    for name in ("broker", "producer", "intruder"):
        made = run_py("keys", "new", name, "--dir", str(root / "keys"))
        assert made.returncode == 0, made.stderr
        assert f"{name}.key_secret" in made.stdout and "authorized_keys" in made.stdout
    (root / "authorized").mkdir()
    (root / "authorized" / "producer.key").write_bytes((root / "keys/producer.key").read_bytes())
    return root


def curve_extra(keys: Path) -> str:
    return (
        f'[security]\nserver_key = "{keys}/keys/broker.key_secret"\n'
        f'authorized_keys = "{keys}/authorized"\n'
    )


@pytest.fixture(scope="module")
def broker(tmp_path_factory, keys):
    """A CURVE broker (one local `sim` worker); stopped and checked at the end."""
    tmp = tmp_path_factory.mktemp("curve")
    config = write_config(
        tmp, workers=1, dispatch=FAST, worker_keys=SIM_WORKER, extra=curve_extra(keys)
    )
    b = Broker(config)
    try:
        b.start()
        b.tmp = tmp
        yield b
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


def key_paths(keys: Path, name: str) -> tuple[str, str]:
    """(NAME's secret key file, the broker's public key file)."""
    return f"{keys}/keys/{name}.key_secret", f"{keys}/keys/broker.key"


def key_args(keys: Path, name: str) -> list[str]:
    key, server_key = key_paths(keys, name)
    return ["--key", key, "--server-key", server_key]


def test_keys_new_writes_a_private_secret_and_refuses_to_overwrite(keys):
    secret = keys / "keys" / "producer.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    public, private = read_key_pair(str(secret), "k")
    assert read_public_key(str(keys / "keys" / "producer.key"), "k") == public
    assert len(private) == 40
    again = run_py("keys", "new", "producer", "--dir", str(keys / "keys"))
    assert again.returncode == exitcodes.FAILED and "already exists" in again.stderr


def probe(broker: Broker, curve: ClientCurve | None, hello: bool = True) -> dict[str, bool]:
    """Send each port a valid request from a fresh DEALER; which ports answered.

    With `hello`, dispatch also gets a WORKER_HELLO from session INTRUDER_SESSION.
    """
    s = broker.settings
    asks = {
        "ingest": (s.ingest.bind, MT.HELLO, {}, None, None),
        "ingest-status": (s.ingest.bind, MT.JOB_STATUS, {"job": "j"}, None, None),
        "dispatch": (s.dispatch.bind, MT.PING, {}, None, None),
        "dispatch-hello": (
            s.dispatch.bind,
            MT.WORKER_HELLO,
            {"session": INTRUDER_SESSION, "model": "echo", "epoch": 0},
            {"held": np.zeros(0, ITEM_DTYPE)},
            INTRUDER_SESSION.encode(),
        ),
        "heartbeat": (s.dispatch.heartbeat_bind, MT.PING, {}, None, None),
        "completion-ping": (s.completion.bind, MT.PING, {}, None, None),
        "completion": (s.completion.bind, MT.JOB_STATUS, {"job": "j"}, None, None),
        "vectors": (s.vectors.bind, MT.PING, {}, None, None),
    }
    if not hello:
        del asks["dispatch-hello"]
    context = zmq.Context()
    sockets = {}
    try:
        for name, (address, kind, meta, arrays, identity) in asks.items():
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 0)  # a refused peer queues; it never blocks the test
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            if curve is not None:
                curve.apply(sock)
            sock.connect(address)
            sockets[name] = sock
            wire.send(sock, kind, meta, arrays)
        answered = dict.fromkeys(asks, False)
        deadline = time.monotonic() + REFUSED_WAIT_S
        while (left := deadline - time.monotonic()) > 0 and not all(answered.values()):
            poller = zmq.Poller()
            for name, sock in sockets.items():
                if not answered[name]:
                    poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(int(left * 1000) + 1):
                name = next(n for n, sk in sockets.items() if sk is sock)
                answered[name] = wire.recv(sock, 0) is not None
        return answered
    finally:
        for sock in sockets.values():
            sock.close(0)
        context.term()


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file in the data dir but the logs."""
    found = {}
    for path in root.rglob("*"):
        name = path.relative_to(root)
        if name.parts[0] != "log":
            info = path.stat()
            found[str(name)] = (info.st_size, info.st_mtime_ns)
    return found


def test_every_port_refuses_a_client_without_an_allowed_key(broker, keys):
    pids = broker.pids()
    own = client_curve(broker.settings.security, *key_paths(keys, "producer"))
    allowed = probe(broker, own, hello=False)
    assert all(allowed.values()), f"an authorized client got no answer: {allowed}"
    before = files_under(broker.data_dir.root)
    intruder = client_curve(broker.settings.security, *key_paths(keys, "intruder"))
    stranger = ClientCurve(*zmq.curve_keypair(), server=own.server)  # a key on no list at all
    for who, curve in (("no key", None), ("an unauthorized key", intruder), ("", stranger)):
        answered = probe(broker, curve)
        assert not any(answered.values()), f"with {who or 'a random key'}, answers: {answered}"
    data = broker.tmp / "intruder.jsonl"
    write_jsonl(data, 10)
    refused = run_py(
        "submit", str(data), "--job-id", "intruder", "--timeout", "0.5",
        "--broker", broker.settings.ingest.bind, *key_args(keys, "intruder"),
    )  # fmt: skip
    assert refused.returncode == exitcodes.UNAVAILABLE, refused.stderr
    assert files_under(broker.data_dir.root) == before  # nothing stored for any of them
    logs = "".join(p.read_text() for p in broker.data_dir.log.glob("*.log"))
    assert INTRUDER_SESSION not in logs and "intruder" not in logs
    assert "refused a CURVE client" in logs  # the unknown keys are named, at most once a minute
    assert broker.pids() == pids and broker.all_up()


def test_an_authorized_producer_worker_and_client_run_a_job_end_to_end(broker, keys):
    s = broker.settings
    data = broker.tmp / "in.jsonl"
    write_jsonl(data, 300)
    ingest = ["--broker", s.ingest.bind, *key_args(keys, "producer")]
    done = run_py("submit", str(data), "--job-id", "j", *ingest)
    assert done.returncode == 0, done.stderr
    worker = zygote.Popen(
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
            *key_args(keys, "producer"),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = broker.tmp / "out.jsonl"
        fetched = run_py(
            "results", "j", "-o", str(out), "--follow", "--broker", s.completion.bind,
            *key_args(keys, "producer"), timeout_s=90,
        )  # fmt: skip
        assert fetched.returncode == 0, fetched.stderr
        assert "state completed" in fetched.stderr
        ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
        assert sorted(ids) == sorted(f"r{i}" for i in range(300))
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    # The local worker and the vector sink are clients too, with the broker's own key; a client
    # on the broker host with its config (no --key) uses that key as well.
    texts = broker.tmp / "texts.jsonl"
    line = {"method": "POST", "url": "/v1/embeddings", "body": {"model": "sim", "input": "w1 w2"}}
    texts.write_text("".join(json.dumps({"custom_id": f"t{i}", **line}) + "\n" for i in range(20)))
    config = ["--config", str(broker.config)]
    done = run_py("submit", str(texts), "--job-id", "v", "--deliver", "vectors", *config)
    assert done.returncode == 0, done.stderr
    delivered = broker.data_dir.root / "vectors" / "delivered" / "v"
    wait_for(delivered.exists, "the vector sink to deliver job v", timeout_s=60)
    stats = run_py("vectors", "stats", "--json", *config)
    assert stats.returncode == 0, stats.stderr
    assert {st["name"]: st["rows"] for st in json.loads(stats.stdout)["stores"]}["sim"] == 20


def test_the_data_dir_is_the_owners_alone(broker):
    wait_for(lambda: list(broker.data_dir.segments.glob("in-*.seg")), "an input segment")
    loose = []
    for path in [broker.data_dir.root, *broker.data_dir.root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            loose.append(f"{path} {mode:o}")
    assert loose == []


def test_a_client_needs_both_keys_and_the_broker_its_pair(tmp_path, keys):
    security = SecuritySettings("", "", False, "", "")
    assert client_curve(security) is None
    with pytest.raises(ConfigError, match="--server-key"):
        client_curve(security, f"{keys}/keys/producer.key_secret")
    with pytest.raises(ConfigError, match=r"--key NAME\.key_secret"):
        client_curve(security, None, f"{keys}/keys/broker.key")
    with pytest.raises(ConfigError, match="only a public key"):
        client_curve(security, f"{keys}/keys/producer.key", f"{keys}/keys/broker.key")
    half = tmp_path / "half.toml"
    half.write_text(f'[security]\nserver_key = "{keys}/keys/broker.key_secret"\n')
    with pytest.raises(ConfigError, match=r"security\.authorized_keys is not"):
        load_settings(half)


def exposed_config(tmp_path: Path, extra: str = "") -> Path:
    config = write_config(tmp_path, extra=extra)
    text = config.read_text().replace('bind = "tcp://127.0.0.1:', 'bind = "tcp://0.0.0.0:', 1)
    config.write_text(text)
    return config


def test_a_bind_beyond_loopback_without_keys_is_refused_unless_allowed(tmp_path, keys):
    config = exposed_config(tmp_path)
    settings = load_settings(config)
    assert settings.ingest.bind.startswith("tcp://0.0.0.0:")
    refused = run_py("--config", str(config))
    assert refused.returncode == exitcodes.CONFIG
    assert f"ingest.bind = '{settings.ingest.bind}'" in refused.stderr
    assert "allow_insecure" in refused.stderr and "server_key" in refused.stderr
    assert not settings.data_path.exists()  # refused before anything was touched
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    open_metrics = write_config(metrics, extra=curve_extra(keys))  # CURVE covers ZeroMQ only
    open_metrics.write_text(
        open_metrics.read_text().replace('bind = "127.0.0.1:', 'bind = "0.0.0.0:')
    )
    refused = run_py("--config", str(open_metrics))
    assert refused.returncode == exitcodes.CONFIG and "metrics.bind" in refused.stderr
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    config = exposed_config(allowed, extra="[security]\nallow_insecure = true\n")
    b = Broker(config)
    try:
        b.start()
        assert f"WARNING supervisor-0 {b.proc.pid} security.allow_insecure" in b.supervisor_log()
        assert "ingest.bind" in b.supervisor_log()
        assert b.stop() == exitcodes.OK, b.stderr
        assert "WARNING" in b.stderr and "ingest.bind" in b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


def test_a_worker_nobody_answers_says_so_and_the_broker_logs_and_warns(tmp_path, keys):
    """A worker with no key, or a key the broker does not accept, says within seconds that it
    gets no answer and that keys are the usual cause; the broker logs each refused handshake
    with the peer's address and the key's prefix, and warns at start that its authorized_keys
    directory is writable by others."""
    loose = tmp_path / "authorized"
    shutil.copytree(keys / "authorized", loose)
    loose.chmod(0o777)
    extra = curve_extra(keys).replace(f"{keys}/authorized", str(loose))
    b = Broker(write_config(tmp_path, extra=extra, dispatch=FAST))
    try:
        b.start()
        warning = f"{loose} is writable by group or others"
        assert warning in b.supervisor_log()
        address = b.settings.dispatch.bind
        said = {}
        for who, args in (("no key", []), ("wrong key", key_args(keys, "intruder"))):
            said[who] = Stderr(
                [
                    *(sys.executable, str(REPO / "run.py"), "worker"),
                    *WorkerOptions(broker=address, model="echo", engine="echo", drain_s=1).argv(),
                    *args,
                ]
            )
        try:
            for who, stderr in said.items():
                wait_for(
                    lambda s=stderr: f"no answer from the broker at {address}" in s.text(),
                    f"the worker with {who} to say it gets no answer",
                    timeout_s=30,
                )
                assert "keys are the usual cause" in stderr.text()
            assert "this worker has no key" in said["no key"].text()
            assert "authorized_keys" in said["wrong key"].text()
        finally:
            for stderr in said.values():
                stderr.stop()
        intruder = read_public_key(f"{keys}/keys/intruder.key", "k").decode()
        logs = "".join(p.read_text() for p in b.data_dir.log.glob("dispatch-*.log"))
        assert f"refused a CURVE client at 127.0.0.1 with key {intruder[:8]}..." in logs
        assert intruder not in logs  # a prefix names it; the whole key is not needed
        assert b.stop() == exitcodes.OK, b.stderr
        assert warning in b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


class Stderr:
    """A process whose stderr is collected as it comes (a pipe nobody reads would block it)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=5)
        self.proc.stderr.close()
