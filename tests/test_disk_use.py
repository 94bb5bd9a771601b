"""Disk use with real processes: a small job leaves a small data dir.

Segments start small and grow with their key's traffic (pipeline/store/segment_append.py), so a
broker with the default `segment_bytes` (256 MiB) does not reserve 256 MiB per active lane,
nor 64 MiB per job for its results.
"""

from __future__ import annotations

import os
from pathlib import Path

from broker import Broker, write_config
from conftest import assert_check_clean, wait_for
from test_dispatch_pipeline import assert_each_once, fetch, finished, submit_job

from pipeline.core import exitcodes

# What the data dir may take after the job: four active lanes of 4 MiB first segments, the
# job's results (a few hundred KiB) and the logs, dispatch files and tables besides.
BOUND_BYTES = 40 << 20


def allocated_bytes(root: Path) -> int:
    """Disk blocks taken by every file under `root` (what `du` counts, not apparent sizes)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def test_a_small_job_leaves_a_small_data_dir_with_the_default_segment_size(tmp_path):
    config = write_config(tmp_path, workers=1)
    config.write_text(config.read_text().replace("segment_bytes = 4194304\n", ""))  # 256 MiB
    b = Broker(config)
    try:
        b.start()
        assert b.settings.broker.segment_bytes == 256 << 20
        submit_job(b, tmp_path, 600, "small")  # echo: four lanes
        wait_for(lambda: finished(b, "small"), "the job to finish", timeout_s=90)
        out = tmp_path / "out.jsonl"
        assert fetch(b, "small", out).returncode == 0
        assert_each_once(out, 600)
        lanes = {p.name.split(".")[-2] for p in b.data_dir.segments.glob("in-*.seg")}
        assert len(lanes) >= 4  # the job really spread over several lanes
        used = allocated_bytes(b.data_dir.root)
        assert used < BOUND_BYTES, f"{used / 2**20:.1f} MiB allocated under {b.data_dir.root}"
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


def test_input_segments_double_up_to_segment_bytes_and_restart_small_when_idle(data_dir):
    import numpy as np
    from conftest import KEY, SLOT_BYTES, make_batch

    from pipeline.store.segment_append import SegmentAppender, SegmentIds

    appender = SegmentAppender(
        data_dir, KEY, SLOT_BYTES, 4 << 20, SegmentIds(data_dir), idle_s=5.0, min_bytes=1 << 20
    )
    rng = np.random.default_rng(0)
    capacities: list[int] = []
    seq0 = 1
    while appender.current is None or appender.current.capacity < appender.capacity:
        assert len(capacities) < 10, capacities
        appender.append(*make_batch(rng, 2048, seq0))
        appender.sync()
        seq0 += 2048
        if appender.current.capacity not in capacities[-1:]:
            capacities.append(appender.current.capacity)
    small = appender.min_capacity
    assert capacities[0] == small and capacities[1] == 2 * small, capacities
    assert capacities[-1] == appender.capacity > capacities[-2]
    assert appender.maybe_rotate(appender.current.last_append_s + 6.0)
    appender.append(*make_batch(rng, 1, seq0))
    assert appender.current.capacity == small  # idle: the next segment starts small again
    appender.close()
    assert_check_clean(data_dir)


def test_growing_segments_of_mixed_sizes_are_dispatched_recovered_and_checked(tmp_path):
    """Segments from 64 KiB doubling to 4 MiB: a broker SIGKILLed mid-job recovers them and
    every item ends once."""
    config = write_config(tmp_path, workers=1, broker_keys="segment_min_bytes = 65536")
    b = Broker(config)
    try:
        b.start()
        submit_job(b, tmp_path, 3000, "grow")
        wait_for(
            lambda: len(list(b.data_dir.segments.glob("in-*.seg"))) >= 8, "rotations", timeout_s=60
        )
        sizes = {p.stat().st_size for p in b.data_dir.segments.glob("in-*.seg")}
        assert len(sizes) >= 3, sizes  # segments of several capacities
        b.kill()
        b.__init__(b.config)
        b.start()
        wait_for(lambda: finished(b, "grow"), "the job to finish after the restart", timeout_s=120)
        out = tmp_path / "out.jsonl"
        assert fetch(b, "grow", out).returncode == 0
        assert_each_once(out, 3000)
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()
