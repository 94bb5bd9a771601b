"""Input faults with real processes: files that must not confuse `submit`, lines that must
not stop a file, ids a model cannot run, and a front that must not buffer without bound."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from broker import REPO, Broker, submit, write_config
from conftest import assert_check_clean


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
    return subprocess.run(
        [sys.executable, "run.py", *args, "--config", str(b.config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout_s,
    )


@pytest.mark.parametrize(
    "content", [b"", b"\xef\xbb\xbf", b"\n  \n\r\n"], ids=["empty", "bom", "blank"]
)
def test_a_file_without_requests_becomes_an_empty_completed_job(broker, tmp_path, content):
    b = broker()
    path = tmp_path / "nothing.jsonl"
    path.write_bytes(content)
    done = submit(b.config, path, "--job-id", "nothing")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "nothing"
    status = cli(b, "status", "nothing", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["state"] == "completed", info
    out = tmp_path / "out.jsonl"
    results = cli(b, "results", "nothing", "-o", str(out))
    assert results.returncode == 0, results.stderr
    assert out.read_bytes() == b""
    assert b.stop() == 0
    assert_check_clean(b.data_dir)
