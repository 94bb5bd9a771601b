"""Input faults with real processes: files that must not confuse `submit`, lines that must
not stop a file, ids a model cannot run, and a front that must not buffer without bound."""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import pytest
from broker import Broker, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from collector.results_client import DispatchClient, ResultsClient
from ingest.submit_client import Producer


@pytest.fixture
def broker(tmp_path):
    started: list[Broker] = []

    def start(**kwargs) -> Broker:
        b = Broker(write_config(tmp_path, **kwargs)).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


def cli(b: Broker, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`run.py ARGS --config <the broker's>`, run in this process (tests/client_commands.py)."""
    return run_cli(*args, "--config", str(b.config))


EMPTY_FILES = {"empty": b"", "bom": b"\xef\xbb\xbf", "blank": b"\n  \n\r\n"}


def test_a_file_without_requests_becomes_an_empty_completed_job(broker, tmp_path):
    b = broker()  # one broker for the three files: each is its own job
    for name, content in EMPTY_FILES.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(content)
        done = submit(b.config, path, "--job-id", name)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        assert done.stdout.strip() == name
        info = b.job_status(name)
        assert info["state"] == "completed", (name, info)
        out = tmp_path / f"{name}.out.jsonl"
        results = cli(b, "results", name, "-o", str(out))
        assert results.returncode == 0, f"{name}: {results.stderr}"
        assert out.read_bytes() == b"", name
    assert b.stop() == 0
    assert_check_clean(b.data_dir)


def embed_lines(path: Path, n: int, prefix: str, poison_at: int | None = None) -> None:
    """n embedding lines for `echo`; the one at `poison_at` starts with the poison token."""
    lines = [
        {
            "custom_id": f"{prefix}{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [POISON if i == poison_at else 5, 7, 8]},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


POISON = 666


def test_a_local_worker_killed_by_a_poison_item_is_restarted_until_the_item_is_dead_lettered(
    tmp_path,
):
    """Point 6: the echo engine SIGKILLs its worker on the poison item, again and again. The
    supervisor used to give up after max_restarts deaths, leaving every later job queued behind
    "(no workers)". Now it keeps restarting the worker with backoff, dispatch dead-letters the
    item (max_attempts = 3 deaths > max_restarts = 1), later jobs complete, and status and the
    metrics say what happened."""
    config = write_config(
        tmp_path,
        workers=1,
        dispatch=FAST,
        extra="max_restarts = 1",
        worker_keys=f"options = {{poison_token = {POISON}}}",  # the echo engine's fault hook
    )
    text = config.read_text().replace("restart_backoff_s = 0.2", "restart_backoff_s = 0.5")
    config.write_text(text)
    b = Broker(config)
    b.start()
    seen: list[dict] = []
    try:
        embed_lines(tmp_path / "p.jsonl", 40, "p", poison_at=7)
        assert submit(b.config, tmp_path / "p.jsonl", "--job-id", "p").returncode == 0
        with DispatchClient(b.settings.dispatch.bind, timeout_s=10) as dispatch:

            def finished(job: str) -> bool:
                seen.extend(dispatch.broker_status()["local_workers"])
                return job_state(b, job) == "completed"

            wait_for(lambda: finished("p"), "the poisoned job to finish", timeout_s=80)
            embed_lines(tmp_path / "later.jsonl", 40, "l")
            assert submit(b.config, tmp_path / "later.jsonl", "--job-id", "later").returncode == 0
            wait_for(lambda: finished("later"), "a later job to finish", timeout_s=30)
        restarting = [s for s in seen if s["state"] == "restarting"]
        assert restarting, "status never showed the worker waiting to be restarted"
        assert all(s["stage"] == "worker-0" and s["last_exit"] == "signal SIGKILL" for s in seen)
        assert max(s["restart_in_s"] for s in restarting) > 0
        assert max(s["deaths_in_a_row"] for s in restarting) >= 2  # more than max_restarts
        status = cli(b, "status", "--json")
        assert status.returncode == 0, status.stderr
        [worker] = json.loads(status.stdout)["local_workers"]
        assert worker["stage"] == "worker-0" and worker["state"] == "running"
        assert worker["deaths"] >= 3 and worker["last_exit"] == "signal SIGKILL"
        plain = cli(b, "status")
        assert "local worker-0: running; died" in plain.stdout, plain.stdout
        scraped = urlopen(f"http://{b.settings.metrics.bind}/metrics", timeout=10).read().decode()
        assert re.search(r'fabric_stage_deaths_in_a_row\{stage="worker-0"\} [2-9]', scraped)
        assert 'fabric_stage_restart_wait_seconds{stage="worker-0"} 0.0' in scraped
        out = tmp_path / "p.out.jsonl"
        assert cli(b, "results", "p", "-o", str(out)).returncode == 0
        errors = [json.loads(e) for e in Path(f"{out}.errors.jsonl").read_text().splitlines()]
        assert ("p7", "dead_lettered") in [(e["custom_id"], e["error"]["code"]) for e in errors]
        later = tmp_path / "later.out.jsonl"
        assert cli(b, "results", "later", "-o", str(later)).returncode == 0
        assert len(later.read_text().splitlines()) == 40
        assert b.stop() == 0, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


FAST = """lease_s = 6.0
session_timeout_s = 2.0
reregister_grace_s = 1.0
report_s = 0.3
max_attempts = 3"""


def job_state(b: Broker, job: str) -> str:
    with ResultsClient(b.settings.completion.bind, timeout_s=10) as client:
        return client.job_status(job)["state"]


SMALL_MODEL = """
[[models]]
name = "small"
engine = "echo"
endpoints = ["/v1/embeddings"]
vocab_size = 100
"""


def test_ids_beyond_the_vocabulary_and_deep_nesting_are_per_line_errors_of_a_real_submit(
    tmp_path,
):
    """Points 6 and 7: `run.py submit` refuses an id the model cannot run, and a line nested
    1,000 deep, each as its own error line, and sends the rest; the front refuses such ids
    again from a producer that skips the checks (submit_tokens sends arrays unchecked)."""
    config = write_config(tmp_path)
    config.write_text(config.read_text() + SMALL_MODEL)
    b = Broker(config).start()
    try:
        good = {"model": "small", "prompt_token_ids": [1, 2, 99]}
        bad = {"model": "small", "prompt_token_ids": [1, 100, 2]}
        lines = [
            json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": body})
            for cid, body in (("g1", good), ("bad", bad), ("deep", {"model": "DEEP"}), ("g2", good))
        ]
        lines[2] = lines[2].replace('"DEEP"', "[" * 1000 + "]" * 1000)
        path = tmp_path / "mixed.jsonl"
        path.write_text("\n".join(lines) + "\n")
        errors_path = tmp_path / "mixed.errors.jsonl"
        done = submit(b.config, path, "--job-id", "mixed", "--errors", str(errors_path))
        assert done.returncode == 0, done.stderr
        assert "2 items queued, 2 lines rejected" in done.stderr
        errors = {
            e["custom_id"]: e["error"]
            for e in map(json.loads, errors_path.read_text().split("\n")[:-1])
        }
        assert errors["bad"]["code"] == "token_out_of_range"
        assert "[1] = 100 is beyond the vocabulary" in errors["bad"]["message"]
        assert errors["deep"]["code"] == "wrong_type"
        with Producer(b.address, timeout_s=10) as producer:
            rows = [np.array([1, 2], np.uint32), np.array([5, 100], np.uint32)]
            report = producer.submit_tokens("raw", "small", rows)
        assert report.stored == 1 and report.rejected == 1
        [error] = report.errors
        assert error["custom_id"] == "item-1" and error["error"]["code"] == "token_out_of_range"
        assert "= 100 is beyond the vocabulary" in error["error"]["message"]
        assert b.stop() == 0, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


FRAME_BYTES = 40 << 20  # announced; above glibc's mmap threshold, so a freed frame leaves RSS
SENT_BYTES = 30 << 20  # sent of it: libzmq holds that much for the connection until it ends


def hold_unfinished_frame(port: int) -> socket.socket | None:
    """A raw ZMTP 3.0 peer (NULL mechanism, as a DEALER) that announces one FRAME_BYTES frame
    and sends SENT_BYTES of it; None if the front cut the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
        s.sendall(b"\x02" + struct.pack(">Q", FRAME_BYTES))
        block = bytes(1 << 20)
        for _ in range(SENT_BYTES // len(block)):
            s.sendall(block)
        return s
    except OSError:  # cut: reset, broken pipe, or a receive side that stopped reading
        s.close()
        return None


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_peer_holding_unfinished_frames_on_many_connections_is_capped(tmp_path):
    """Point 10: libzmq buffers each connection's unfinished frame (up to max_message_bytes)
    where the front cannot see it; 8 connections x 30 MiB took the front from ~46 to ~286 MiB.
    With max_peer_connections = 2 the others are cut as soon as they are accepted."""
    config = write_config(tmp_path)
    config.write_text(
        config.read_text().replace("[ingest]\n", "[ingest]\nmax_peer_connections = 2\n")
    )
    b = Broker(config).start()
    try:
        front = b.pids()["front-0"]
        port = int(b.address.rsplit(":", 1)[1])
        before = rss_mib(front)
        held = [hold_unfinished_frame(port) for _ in range(8)]
        kept = [s for s in held if s is not None]
        grown = rss_mib(front) - before
        assert len(kept) <= 2
        assert grown < 3 * (SENT_BYTES >> 20), f"the front grew by {grown} MiB"
        for s in kept:
            s.close()
        path = tmp_path / "after.jsonl"
        embed_lines(path, 10, "a")
        done = None

        def submitted() -> bool:  # once the front has seen the hoarders go, submit gets in
            nonlocal done
            done = submit(b.config, path, "--job-id", "after", "--timeout", "2", "--attempts", "2")
            return done.returncode == 0

        wait_for(submitted, "a producer to get in once the hoarders left", timeout_s=60)
        assert b.stop() == 0, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()
