"""The test harness itself: what it does where a test's capability is missing, and what a
broker it started leaves behind."""

from __future__ import annotations

import socket

import pytest
from broker import Broker, write_config
from conftest import skip_or_fail

from pipeline.transport.binds import host_port


def test_a_missing_capability_skips_here_and_fails_where_ci_is_set(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_or_fail("needs root")
    monkeypatch.setenv("CI", "true")  # as GitHub Actions and most CI services set it
    with pytest.raises(pytest.fail.Exception, match="needs root; CI is set"):
        skip_or_fail("needs root")


def test_a_broker_that_exits_at_start_leaves_no_pipe_open(tmp_path):
    """Its stderr pipe, left to the garbage collector, was a ResourceWarning (an error here)
    in whichever later test ran when it was collected."""
    config = write_config(tmp_path)
    broker = Broker(config)
    port = host_port(broker.settings.completion.bind)[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        with pytest.raises(AssertionError, match="exited"):
            broker.start()
    assert broker.proc.stderr.closed
    broker.close()
