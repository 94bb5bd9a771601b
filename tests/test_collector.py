"""The collector removes finished segments, never one another process holds open."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import appender, assert_check_clean, make_batch

from collector.segments import SegmentCollector
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_format import HEADER_BYTES

PROCS = Path(__file__).parent / "procs"


def build(data_dir, rng, retire_all: tuple[int, ...]):
    log = appender(data_dir, segment_bytes=HEADER_BYTES * 2 + 100 * 288)
    log.append(*make_batch(rng, 300, 1))
    log.close()
    paths = data_dir.segment_files()
    for i in retire_all:
        with Segment.open(paths[i], writable=True) as seg:
            seg.tombstone(np.arange(100))
            seg.sync()
    return paths


def test_finished_segments_are_removed_and_others_kept(data_dir, rng):
    paths = build(data_dir, rng, retire_all=(0, 2))
    report = recover(data_dir)
    assert [s.path for s in report.finished] == [paths[0], paths[2]]
    result = SegmentCollector().offer([*report.finished, report.segments[1]])
    assert result.removed == [paths[0], paths[2]]
    assert result.not_finished == [paths[1]]
    assert data_dir.segment_files() == [paths[1]]
    assert_check_clean(data_dir)


def test_a_segment_held_by_a_reader_process_waits_until_released(data_dir, rng):
    paths = build(data_dir, rng, retire_all=(0,))
    report = recover(data_dir)
    reader = subprocess.Popen(
        [sys.executable, str(PROCS / "segment_reader.py"), str(paths[0])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().startswith("holding")
        collector = SegmentCollector(retry_s=1.0)
        result = collector.offer(report.finished)
        assert result.in_use == [paths[0]] and paths[0].exists()
        assert collector.pending == {paths[0]}
        assert collector.step(now_s=0.5).in_use == [paths[0]]
        assert collector.step(now_s=1.0).in_use == []  # not yet time to retry
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
        reader.stdout.close()
    assert collector.step(now_s=2.0).removed == [paths[0]]
    assert not paths[0].exists() and not collector.pending
    assert_check_clean(data_dir)


def test_a_segment_still_live_is_never_removed_even_if_offered(data_dir, rng):
    paths = build(data_dir, rng, retire_all=())
    with Segment.open(paths[0], writable=True) as seg:
        seg.tombstone(np.arange(99))
        seg.sync()
    assert SegmentCollector().offer([paths[0]]).not_finished == [paths[0]]
    assert paths[0].exists()
