"""Segment files and the rotating appender, on real files."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import KEY, SLOT_BYTES, appender, assert_check_clean, make_batch

from pipeline.core.errors import SegmentError, SegmentFullError, SegmentSealedError
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_append import SegmentIds
from pipeline.store.segment_format import (
    DEAD,
    HEADER_BYTES,
    LIVE,
    capacity_for,
    marker_region_bytes,
    segment_file_name,
)


def test_append_sync_reopen_reads_the_same_items(data_dir, rng):
    log = appender(data_dir)
    seq, job, index, counts, tokens = make_batch(rng, 100, 1)
    placed = log.append(seq, job, index, counts, tokens)
    log.sync()
    assert placed["count"].sum() == 100
    with Segment.open(log.current.path) as seg:
        got = seg.slots[:100]
        assert np.array_equal(got["seq"], seq)
        assert np.array_equal(got["count"], counts)
        assert np.array_equal(seg.words[:100, 8:], tokens)
        assert seg.verify(np.arange(100)).all()
        assert (seg.states()[:100] == LIVE).all() and (seg.states()[100:] == 0).all()
        assert seg.entries == 100 and seg.deleted == 0 and not seg.sealed
    log.close()
    assert_check_clean(data_dir)


def test_file_layout_matches_the_documented_table(data_dir):
    capacity = 1000
    seg = Segment.create(data_dir.segments, 9, KEY, SLOT_BYTES, capacity)
    assert seg.path.name == "in-000000000009.minilm.s1.l64.seg" == segment_file_name(9, KEY)
    assert (
        seg.path.stat().st_size
        == HEADER_BYTES + marker_region_bytes(capacity) + capacity * SLOT_BYTES
    )
    assert marker_region_bytes(capacity) == 4096
    raw = seg.path.read_bytes()
    assert raw[:8] == b"IFABSEG\0"
    seg.close()


def test_rotation_when_full_spreads_a_batch_over_segments(data_dir, rng):
    log = appender(data_dir, segment_bytes=1 << 17)
    per_segment = capacity_for(1 << 17, SLOT_BYTES)
    n = per_segment * 2 + 5
    placed = log.append(*make_batch(rng, n, 1))
    log.sync()
    assert list(placed["count"]) == [per_segment, per_segment, 5]
    assert list(placed["first"]) == [0, 0, 0]
    ids = list(placed["segment"])
    assert ids == sorted(ids) and len(set(ids)) == 3
    for path in data_dir.segment_files()[:2]:
        with Segment.open(path) as seg:
            assert seg.sealed and seg.entries == per_segment
    log.close()
    assert_check_clean(data_dir)


def test_idle_rotation_seals_the_segment(data_dir, rng):
    log = appender(data_dir, idle_s=5.0)
    log.append(*make_batch(rng, 3, 1))
    first = log.current
    assert not log.maybe_rotate(first.last_append_s + 1.0)
    assert log.maybe_rotate(first.last_append_s + 5.0)
    assert log.current is None
    log.sync()
    placed = log.append(*make_batch(rng, 3, 4))
    assert placed["segment"][0] > first.segment_id
    log.close()
    with Segment.open(data_dir.segment_files()[0]) as seg:
        assert seg.sealed


def test_tombstone_is_vectorised_idempotent_and_moves_the_count_after(data_dir, rng):
    log = appender(data_dir)
    log.append(*make_batch(rng, 50, 1))
    log.sync()
    with Segment.open(log.current.path, writable=True) as seg:
        assert seg.tombstone(np.array([3, 3, 4, 10])) == 3
        assert seg.tombstone(np.array([4, 10, 11])) == 1
        assert seg.deleted == 4
        assert list(np.flatnonzero(seg.states() == DEAD)) == [3, 4, 10, 11]
        with pytest.raises(SegmentError, match="slot 60"):
            seg.tombstone(np.array([60]))
        with pytest.raises(SegmentError, match="out of range"):
            seg.tombstone(np.array([seg.capacity]))
        seg.sync()
    log.close()
    assert_check_clean(data_dir)


def test_attempts_byte_never_undoes_a_retire(data_dir, rng):
    log = appender(data_dir)
    log.append(*make_batch(rng, 10, 1))
    seg = log.current
    seg.set_attempts(np.array([1, 2]), np.array([1, 300]))
    assert list(seg.attempts(np.array([1, 2, 3]))) == [1, 255, 0]
    seg.tombstone(np.array([1]))
    seg.set_attempts(np.array([1]), np.array([2]))
    assert seg.states()[1] == DEAD
    log.close()


def test_append_refusals_name_the_problem(data_dir, rng):
    seg = Segment.create(data_dir.segments, 1, KEY, SLOT_BYTES, 4)
    with pytest.raises(SegmentFullError, match="do not fit"):
        seg.append(*make_batch(rng, 5, 1))
    seq, job, index, counts, _ = make_batch(rng, 1, 1)
    with pytest.raises(SegmentError, match="exceeds the slot body"):
        seg.append(seq, job, index, counts, np.zeros((1, 65), np.uint32))
    seg.seal()
    with pytest.raises(SegmentSealedError):
        seg.append(*make_batch(rng, 1, 1))
    seg.close()
    again = Segment.open(data_dir.segment_files()[0], writable=True)
    with pytest.raises(SegmentSealedError, match="not created in this process life"):
        again.append(*make_batch(rng, 1, 1))
    again.close()


def test_segment_ids_are_unique_across_processes(data_dir):
    code = (
        "import sys; from pipeline.store.datadir import DataDir; from pipeline.store.segment_append import SegmentIds;"
        "ids = SegmentIds(DataDir(sys.argv[1]));"
        "print(' '.join(str(ids.allocate()) for _ in range(50)))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(data_dir.root)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    got = [int(x) for p in procs for x in p.communicate(timeout=60)[0].split()]
    assert all(p.returncode == 0 for p in procs)
    assert len(got) == 200 and len(set(got)) == 200


def test_ids_never_go_below_existing_files_even_without_the_counter(data_dir, rng):
    log = appender(data_dir)
    log.append(*make_batch(rng, 1, 1))
    log.close()
    (data_dir.root / SegmentIds.FILE).unlink()
    assert SegmentIds(data_dir).allocate() == log_segment_id(data_dir) + 1


def log_segment_id(data_dir) -> int:
    return max(int(p.name.split("-")[1].split(".")[0]) for p in data_dir.segment_files())


def test_recovery_summarises_seals_and_recounts(data_dir, rng):
    log = appender(data_dir, segment_bytes=1 << 17)
    log.append(*make_batch(rng, 800, 1))
    log.sync()
    paths = data_dir.segment_files()
    with Segment.open(paths[0], writable=True) as seg:
        seg.tombstone(np.arange(seg.capacity))  # first segment fully retired
        seg.sync()
    with Segment.open(paths[1], writable=True) as seg:
        seg.tombstone(np.arange(0, 10))
        seg.write_counts(999, 999)  # a stale cache recovery must not believe
        seg.sync()
    del log  # a crash: nothing sealed, nothing closed
    report = recover(data_dir, processes=2)
    by_id = {s.segment_id: s for s in report.segments}
    first, second = by_id[1], by_id[2]
    assert first.finished and first.live == 0
    assert second.first_live == 10 and second.dead == 10 and not second.finished
    assert all(s.sealed for s in report.segments)
    assert report.live == 800 - first.dead - 10
    with Segment.open(paths[1]) as seg:
        assert (seg.entries, seg.deleted) == (second.entries, 10)
    assert_check_clean(data_dir)


def test_segment_too_small_for_one_slot_is_refused_with_the_fix(data_dir):
    from pipeline.store.segment_append import SegmentAppender
    from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for

    key = SegmentKey(KIND_INPUT, "big", 0, 1 << 20)
    with pytest.raises(
        SegmentError, match=r"segment_bytes 1048576 cannot hold one slot .*\(lane 1048576\)"
    ):
        SegmentAppender(data_dir, key, slot_bytes_for(4 << 20), 1 << 20, SegmentIds(data_dir))


def test_sealing_records_when(data_dir, rng):
    log = appender(data_dir)
    log.append(*make_batch(rng, 3, 1))
    assert log.current.sealed_ns == 0
    log.close()
    crashed = appender(data_dir)
    crashed.append(*make_batch(rng, 3, 4))
    crashed.sync()
    del crashed  # unsealed: recovery seals it and records when
    recover(data_dir)
    for path in data_dir.segment_files():
        with Segment.open(path) as seg:
            assert seg.sealed and seg.sealed_ns >= seg.header.created_ns
