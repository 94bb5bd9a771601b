"""Scaling out: workers on other "hosts" (Linux network namespaces) join one broker over TCP.

Each worker host is a network namespace joined to this one by a veth pair:
its only route to the broker is the pair's address, as a GPU host's would be
(its loopback is its own). The broker binds dispatch beyond loopback, which
it only does with CURVE keys; each host gets its own key pair, authorized by
copying its public key into the broker's authorized_keys. Every authorized
host's `python run.py worker` joins the fleet and takes part in the job; a
host with a key nobody authorized gets no work. Skipped where namespaces
cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from broker import REPO, Broker, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, skip_or_fail, wait_for

from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.core.errors import FabricError

HOSTS = 3  # authorized worker hosts; one more host holds a key nobody authorized
FAST = "lease_s = 6.0\nsession_timeout_s = 2.0\nreregister_grace_s = 0.5\nreport_s = 0.3"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts():
    """HOSTS + 1 namespaces: (name, the broker's address as that host sees it)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        skip_or_fail("network namespaces need root and iproute2 (`ip`)")
    made: list[tuple[str, str]] = []
    tag = os.getpid() % 10000
    try:
        for i in range(HOSTS + 1):
            name, veth = f"fab{tag}h{i}", f"fab{tag}v{i}"
            added = ip("netns", "add", name)
            if added.returncode != 0:
                skip_or_fail(f"cannot make a network namespace here: {added.stderr.strip()}")
            made.append((name, f"10.79.{i}.1"))
            for args in (
                ("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name),
                ("addr", "add", f"10.79.{i}.1/30", "dev", veth),
                ("link", "set", veth, "up"),
                ("netns", "exec", name, "ip", "addr", "add", f"10.79.{i}.2/30", "dev", "eth0"),
                ("netns", "exec", name, "ip", "link", "set", "eth0", "up"),
                ("netns", "exec", name, "ip", "link", "set", "lo", "up"),
            ):
                done = ip(*args)
                if done.returncode != 0:
                    skip_or_fail(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
        yield made
    finally:
        for i, (name, _) in enumerate(made):
            ip("link", "del", f"fab{tag}v{i}")
            ip("netns", "del", name)


def run_py(*args: str) -> subprocess.CompletedProcess:
    """`run.py ARGS`, run in this process (tests/client_commands.py)."""
    return run_cli(*args)


def test_workers_on_other_hosts_join_with_their_keys(tmp_path, hosts):
    keys, authorized = tmp_path / "keys", tmp_path / "authorized_keys"
    authorized.mkdir()
    for name in ["broker", *(f"host{i}" for i in range(len(hosts)))]:
        made = run_py("keys", "new", name, "--dir", str(keys))
        assert made.returncode == 0, made.stderr
    for i in range(HOSTS):  # the last host's key is never authorized
        shutil.copy(keys / f"host{i}.key", authorized / f"host{i}.key")
    config = write_config(
        tmp_path,
        workers=0,
        dispatch=FAST,
        extra=f'[security]\nserver_key = "{keys}/broker.key_secret"\n'
        f'authorized_keys = "{authorized}"\n',
    )
    text = config.read_text()
    dispatch_port = re.search(r'\[dispatch\]\nbind = "tcp://127.0.0.1:(\d+)"', text)[1]
    heartbeat_port = re.search(r'heartbeat_bind = "tcp://127.0.0.1:(\d+)"', text)[1]
    for port in (dispatch_port, heartbeat_port):  # reachable from the worker hosts
        text = text.replace(f"tcp://127.0.0.1:{port}", f"tcp://0.0.0.0:{port}")
    config.write_text(text)
    b = Broker(config).start()
    workers = []
    try:
        for i, (namespace, broker_ip) in enumerate(hosts):
            log = open(tmp_path / f"host{i}.log", "w")  # noqa: SIM115 - closed below
            workers.append(
                (
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            namespace,
                            sys.executable,
                            str(REPO / "run.py"),
                            "worker",
                            *WorkerOptions(
                                broker=f"tcp://{broker_ip}:{dispatch_port}",
                                model="echo",
                                heartbeat=f"tcp://{broker_ip}:{heartbeat_port}",
                                engine="echo",
                                batch_items=16,
                                target_batch_s=0,
                            ).argv(),
                            "--key",
                            str(keys / f"host{i}.key_secret"),
                            "--server-key",
                            str(keys / "broker.key"),
                        ],
                        cwd=REPO,
                        stdout=log,
                        stderr=log,
                    ),
                    log,
                )
            )

        def workers_seen() -> list[dict]:
            """What `status --json` lists, asked in-process (polled: not an interpreter each)."""
            try:
                return b.broker_status(attempts=1)["workers"]
            except FabricError:
                return []

        def sessions() -> int:
            return len(workers_seen())

        wait_for(lambda: sessions() == HOSTS, f"the {HOSTS} authorized hosts to join", timeout_s=60)
        path = tmp_path / "in.jsonl"
        good = write_jsonl(path, 1200)
        submitted = run_py("submit", str(path), "--job-id", "fleet", "--config", str(config))
        assert submitted.returncode == 0, submitted.stderr
        out = tmp_path / "out.jsonl"
        fetched = run_py("results", "fleet", "-o", str(out), "--follow", "--config", str(config))
        assert fetched.returncode == 0, fetched.stderr
        assert len(out.read_text().splitlines()) == len(good)
        retired = wait_for(
            lambda: (r := [w["retired"] for w in workers_seen()]) and sum(r) == len(good) and r,
            "dispatch to count every result retired",
        )
        assert len(retired) == HOSTS  # the stranger never joined
        shown = run_py("status", "--json", "--config", str(config))  # the command says the same
        assert shown.returncode == 0, shown.stderr
        assert sorted(w["retired"] for w in json.loads(shown.stdout)["workers"]) == sorted(retired)
        assert all(n > 0 for n in retired), retired  # every authorized host did work
    finally:
        for proc, _ in workers:
            proc.send_signal(signal.SIGTERM)
        for proc, log in workers:
            proc.wait(timeout=60)
            log.close()
    assert b.stop() == exitcodes.OK
    b.close()
    assert_check_clean(b.data_dir)
