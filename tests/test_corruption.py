"""Bad files on disk: recovery neither crashes nor loses a good slot; check names each finding."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import appender, assert_check_clean, make_batch

from assembly.check import check_data_dir
from pipeline.core.errors import SegmentFormatError
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_format import HEADER_BYTES, HEADER_CHECKED, LIVE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_segments(data_dir, rng):
    """Two sealed segments of 300 LIVE items each; returns their paths."""
    log = appender(data_dir, segment_bytes=HEADER_BYTES * 2 + 300 * 288)
    log.append(*make_batch(rng, 600, 1))
    log.close()
    paths = data_dir.segment_files()
    assert len(paths) == 2
    return paths


def codes(data_dir) -> list[str]:
    return sorted(f.code for f in check_data_dir(data_dir).findings)


def test_truncated_file_is_quarantined_and_the_other_segment_survives(data_dir, two_segments):
    bad, good = two_segments
    os.truncate(bad, bad.stat().st_size // 2)
    report = recover(data_dir)
    assert [d.code for d in report.damaged] == ["wrong-size"]
    assert [s.path for s in report.segments] == [good] and report.live == 300
    assert codes(data_dir) == ["wrong-size"]


@pytest.mark.parametrize("content", ["zeros", "random", "short"])
def test_garbage_files_are_reported_not_served(data_dir, two_segments, content):
    junk = data_dir.segments / "in-000000000099.minilm.s1.l64.seg"
    size = {"zeros": 1 << 20, "random": 1 << 20, "short": 10}[content]
    data = bytes(size) if content == "zeros" else np.random.default_rng(5).bytes(size)
    junk.write_bytes(data)
    report = recover(data_dir)
    assert [d.path for d in report.damaged] == [junk]
    assert report.live == 600
    expected = "wrong-size" if content == "short" else "bad-magic"
    assert codes(data_dir) == [expected]
    with pytest.raises(SegmentFormatError, match=r"bad magic|shorter than a header"):
        Segment.open(junk)


def test_header_from_a_newer_version_is_refused_by_name(data_dir, two_segments):
    path = two_segments[0]
    with open(path, "r+b") as f:
        head = bytearray(f.read(HEADER_CHECKED))
        struct.pack_into("<I", head, 8, 2)
        f.seek(0)
        f.write(head + struct.pack("<I", zlib.crc32(head)))
    report = recover(data_dir)
    assert report.damaged[0].code == "bad-version"
    assert "newer version" in report.damaged[0].reason
    assert report.live == 300


def test_damaged_header_checksum(data_dir, two_segments):
    with open(two_segments[1], "r+b") as f:
        f.seek(60)
        f.write(b"X")
    assert codes(data_dir) == ["bad-header"]


def test_flipped_bit_in_a_middle_slot_is_reported_and_never_lost(data_dir, two_segments):
    path = two_segments[0]
    with Segment.open(path, writable=True) as seg:
        seg.bodies[100, 9] ^= 0x10
        seg.sync()
    report = recover(data_dir)
    summary = next(s for s in report.segments if s.path == path)
    assert summary.live == 300 and summary.torn == ()  # not a tail: kept, reported
    with Segment.open(path) as seg:
        ok = seg.verify(np.arange(300))
        assert list(np.flatnonzero(~ok)) == [100]
    findings = check_data_dir(data_dir).findings
    assert [(f.code, "slot 100" in f.message) for f in findings] == [("bad-checksum", True)]


def test_slot_torn_halfway_at_the_tail_is_cut(data_dir, rng):
    log = appender(data_dir)
    log.append(*make_batch(rng, 50, 1))
    log.sync()
    seg = log.current
    half = seg.header.slot_bytes // 2
    seg.bodies[49, half - 32 :] ^= 0x5A  # the second half is not what was written
    seg.bodies[48, :8] ^= 0xFF
    seg.sync()
    del log, seg  # crash: unsealed, counts as the writer left them
    assert codes(data_dir) == ["torn-tail"]
    report = recover(data_dir)
    (summary,) = report.segments
    assert summary.torn == (48, 49) and summary.live == 48 and summary.end == 48
    with Segment.open(summary.path) as s:
        assert (s.states()[:48] == LIVE).all() and (s.states()[48:] == 0).all()
        assert s.entries == 48
    assert_check_clean(data_dir)


def test_unknown_markers_and_stale_counts_and_orphans(data_dir, two_segments):
    path = two_segments[0]
    with Segment.open(path, writable=True) as seg:
        seg.markers[7] = 0x77
        seg.write_counts(5, 3)
        seg.sync()
    (data_dir.segments / ".in-000000000050.minilm.s1.l64.seg.tmp").write_bytes(b"half made")
    (data_dir.segments / "notes.txt").write_text("hello")
    assert codes(data_dir) == ["count-mismatch", "orphan-temp", "stray-file", "unknown-marker"]
    report = recover(data_dir)
    summary = next(s for s in report.segments if s.path == path)
    assert summary.unknown == 1 and summary.live == 299 and not summary.finished
    assert len(report.removed_temp) == 1


def run_check(data_dir, *extra: str) -> subprocess.CompletedProcess:
    config = data_dir.root.parent / "check.toml"
    config.write_text(f'[broker]\ndata_dir = "{data_dir.root}"\n')
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), "check", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_check_command_reports_fixes_and_exits_by_the_book(data_dir, two_segments):
    path = two_segments[1]
    with Segment.open(path, writable=True) as seg:
        seg.write_counts(1, 1)
        seg.sync()
    (data_dir.segments / ".in-000000000070.minilm.s1.l64.seg.tmp").write_bytes(b"")
    first = run_check(data_dir)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "count-mismatch" in first.stdout and "orphan-temp" in first.stdout
    assert "can be repaired with --fix" in first.stdout
    fixed = run_check(data_dir, "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "fixed:" in fixed.stdout and "removed orphan" in fixed.stdout
    again = run_check(data_dir)
    assert again.returncode == 0 and "clean: 2 segment file(s)" in again.stdout


def test_check_refuses_a_data_dir_in_use(data_dir, two_segments):
    data_dir.lock()
    try:
        result = run_check(data_dir)
    finally:
        data_dir.unlock()
    assert result.returncode == 4
    assert f"in use by pid {os.getpid()}" in result.stderr
