"""A real full disk: a size-limited tmpfs under the data dir, filled by appends."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import appender, assert_check_clean, make_batch, small_tmpfs

from pipeline.datadir import DataDir
from pipeline.errors import DiskFullError
from pipeline.recovery import recover
from pipeline.segment import Segment
from pipeline.segment_format import LIVE


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "small", "3m") as mount_point:
        yield mount_point


def test_full_disk_fails_the_append_clearly_keeps_acked_items_and_recovers(small_fs, rng):
    data_dir = DataDir(small_fs / "fabric").ensure()
    filler = small_fs / "filler"
    filler.write_bytes(bytes(1 << 20))
    log = appender(data_dir, segment_bytes=1 << 18)
    acked = 0
    seq = 1
    with pytest.raises(DiskFullError, match="disk full while creating a segment") as caught:
        for _ in range(1000):
            log.append(*make_batch(rng, 200, seq))
            log.sync()
            acked += 200
            seq += 200
    assert caught.value.retryable and acked > 0
    assert str(data_dir.segments) in str(caught.value)

    def live_seqs() -> np.ndarray:
        found = []
        for path in data_dir.segment_files():
            with Segment.open(path) as seg:
                found.append(seg.slots["seq"][seg.states() == LIVE])
        return np.sort(np.concatenate(found))

    assert np.array_equal(live_seqs(), np.arange(1, acked + 1))  # nothing of the failed batch
    filler.unlink()
    log.append(*make_batch(rng, 200, seq))
    log.sync()
    log.close()
    assert np.array_equal(live_seqs(), np.arange(1, acked + 201))
    report = recover(data_dir)
    assert report.live == acked + 200 and not report.damaged
    assert_check_clean(data_dir)
