"""Shared fixtures: real data dirs, item batches, and the closing consistency check."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time

import numpy as np
import pytest

from pipeline.datadir import DataDir
from pipeline.segment_append import SegmentAppender, SegmentIds
from pipeline.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for

LANE = 64
KEY = SegmentKey(KIND_INPUT, "minilm", shape=1, lane=LANE)
SLOT_BYTES = slot_bytes_for(LANE * 4)


def make_batch(rng: np.random.Generator, n: int, seq0: int, lane: int = LANE):
    """n items with consecutive seqs from seq0 and random token counts up to `lane`."""
    counts = rng.integers(1, lane + 1, n).astype(np.uint32)
    tokens = rng.integers(0, 30_000, (n, lane)).astype(np.uint32)
    tokens[np.arange(lane)[None, :] >= counts[:, None]] = 0
    seq = np.arange(seq0, seq0 + n, dtype=np.uint64)
    job = np.full(n, 7, dtype=np.uint64)
    index = (seq - 1).astype(np.uint32)
    return seq, job, index, counts, tokens


def appender(
    data_dir: DataDir, segment_bytes: int = 1 << 18, idle_s: float = 30.0
) -> SegmentAppender:
    return SegmentAppender(data_dir, KEY, SLOT_BYTES, segment_bytes, SegmentIds(data_dir), idle_s)


def assert_check_clean(data_dir: DataDir) -> None:
    """The project's own consistency check must find nothing."""
    from assembly.check import check_data_dir  # the whole top floor: child processes skip it

    report = check_data_dir(data_dir)
    assert report.clean, "\n".join(f.line() for f in report.remaining)


@pytest.fixture
def data_dir(tmp_path) -> DataDir:
    return DataDir(tmp_path / "fabric").ensure()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def wait_for(condition, what: str, timeout_s: float = 30.0, interval_s: float = 0.02):
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        pause.wait(interval_s)


def skip_or_fail(reason: str) -> None:
    """Skip a test that needs what this machine lacks (root, network namespaces); where the
    `CI` environment variable is set, fail it instead: CI runs as root and must run it."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, where this test must run (it runs as root)")
    pytest.skip(reason)


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A size-limited tmpfs mounted at `path` (a real full disk); skips the test without root
    (fails it where `CI` is set: skip_or_fail)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        skip_or_fail(f"cannot mount a small tmpfs here ({result.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
