"""Output, tombstone, count, in that order; one result per item, whatever repeats."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zygote
from conftest import appender, assert_check_clean, make_batch

from collector.completion.record_format import SIZE_CLASSES
from collector.completion.results_log import CompletionLog, Results
from pipeline.core.result_kinds import ResultStatus
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, LIVE

PROCS = Path(__file__).parent / "procs"


def inputs(data_dir, n: int = 50):
    log = appender(data_dir, segment_bytes=1 << 15)  # several small input segments
    seq = (np.uint64(7) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
    batch = list(make_batch(np.random.default_rng(0), n, 1))
    batch[0] = seq
    log.append(*batch)
    log.close()
    return {
        s.segment_id: s for s in (Segment.open(p, writable=True) for p in data_dir.segment_files())
    }


def results(segs, picks, status=ResultStatus.RESULT, size=10, seq_offset=0) -> Results:
    seg_ids, slots = zip(*picks, strict=True)
    seg_ids, slots = np.array(seg_ids, np.uint64), np.array(slots, np.int64)
    seqs = np.array(
        [segs[int(s)].slots["seq"][k] + seq_offset for s, k in zip(seg_ids, slots, strict=True)],
        np.uint64,
    )
    payload = np.arange(size * len(slots), dtype=np.uint8)
    offsets = np.arange(len(slots) + 1) * size
    return Results(
        "job-c", 7, seg_ids, slots, seqs, np.full(len(slots), status, np.uint32), payload, offsets
    )


def completion_rows(data_dir):
    rows = []
    for path in data_dir.completion.glob("out-*.seg"):
        with Segment.open(path) as seg:
            written = np.flatnonzero(seg.states())
            assert seg.verify(written).all()
            rows += list(
                zip(
                    seg.slots["index"][written].tolist(),
                    (seg.slots["flags"][written] & 0x0F).tolist(),
                    strict=True,
                )
            )
    return rows


def test_results_are_stored_then_inputs_retired_and_counted_once(data_dir):
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    picks = [(first, k) for k in range(5)]
    recorded = log.record(results(segs, picks))
    assert (recorded.stored, recorded.duplicates, recorded.refused) == (5, 0, [])
    assert (segs[first].states()[:5] == DEAD).all() and segs[first].deleted == 5
    assert {k: v.tolist() for k, v in log.flush_tombstones().items()} == {first: [0, 1, 2, 3, 4]}
    again = log.record(results(segs, picks))  # computation repeated
    assert (again.stored, again.duplicates) == (0, 5)
    assert log.completed("job-c") == 5
    log.close()
    assert sorted(completion_rows(data_dir)) == [(i, ResultStatus.RESULT) for i in range(5)]


def test_a_duplicate_of_a_retired_item_is_named_retired_again(data_dir):
    """Issue 14 point 8: dispatch sends an item error again until a RETIRED names it; if the
    first RETIRED was lost (completion killed after the tombstone), the resent copy finds its
    slot DEAD. It is a duplicate, and the next flush names the slot again, so the resend ends."""
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    log.record(results(segs, [(first, 0), (first, 1)], status=ResultStatus.ERROR))
    log.close()  # killed before its flush: what it retired was never told
    restarted = CompletionLog(data_dir, segs.__getitem__)
    assert restarted.flush_tombstones() == {}
    again = restarted.record(results(segs, [(first, 0), (first, 1)], status=ResultStatus.ERROR))
    assert (again.stored, again.duplicates) == (0, 2)
    assert {k: v.tolist() for k, v in restarted.flush_tombstones().items()} == {first: [0, 1]}
    restarted.close()


def test_a_crash_between_output_and_tombstone_heals_without_a_second_result(data_dir):
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    log.record(results(segs, [(first, 0), (first, 1)], status=ResultStatus.ERROR))
    log.close()
    segs[first].markers[[0, 1]] = LIVE  # the tombstones never reached the disk
    restarted = CompletionLog(data_dir, segs.__getitem__)
    assert restarted.completed("job-c") == 2  # rebuilt from the completion log itself
    recorded = restarted.record(
        results(segs, [(first, 0), (first, 1), (first, 2)])
    )  # re-dispatched
    assert (recorded.stored, recorded.duplicates) == (1, 2)
    assert (segs[first].states()[:3] == DEAD).all()
    restarted.close()
    assert sorted(completion_rows(data_dir)) == [
        (0, ResultStatus.ERROR),
        (1, ResultStatus.ERROR),
        (2, ResultStatus.RESULT),
    ]


def test_stale_and_forged_results_are_refused_by_name_and_oversized_ones_become_errors(data_dir):
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    wrong = log.record(results(segs, [(first, 3)], seq_offset=1))
    assert wrong.stored == 0 and "does not match the slot (another item)" in wrong.refused[0]
    empty_slot = segs[first].entries + 1
    seg = segs[first]
    forged = Results(
        "job-c",
        7,
        np.array([first], np.uint64),
        np.array([empty_slot]),
        np.array([1], np.uint64),
        np.zeros(1, np.uint32),
        np.zeros(1, np.uint8),
        np.array([0, 1]),
    )
    assert "never written" in log.record(forged).refused[0]
    assert (seg.states()[3:5] == LIVE).all()
    big = log.record(results(segs, [(first, 4)], size=SIZE_CLASSES[-1]))
    assert (big.stored, big.refused) == (1, [])
    assert log.failed("job-c") == 1 and seg.states()[4] == DEAD
    page = log.page("job-c", 10)
    assert page.status.tolist() == [ResultStatus.ERROR]
    assert bytes(page.payload).startswith(b"result_too_large")
    log.close()


def test_results_are_read_back_in_pages_and_delivered_once(data_dir):
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    small = results(segs, [(first, k) for k in range(6)], size=10)
    small.prompt_tokens = np.arange(6, dtype=np.uint32) + 100
    log.record(small)
    log.record(results(segs, [(first, 6)], size=3000))  # another size class
    log.record_errors("job-c", 7, np.array([40, 41]), ["invalid_json: line 41", "x: line 42"])
    log.sync_outputs()
    assert (log.completed("job-c"), log.failed("job-c")) == (9, 2)
    page = log.page("job-c", 4)
    assert page.index.tolist() == [0, 1, 2, 3]
    assert page.prompt_tokens.tolist() == [100, 101, 102, 103]
    assert np.array_equal(page.payload, small.payload[:40])
    log.delivered("job-c", page.where)
    rest = log.page("job-c", 100)
    assert sorted(rest.index.tolist()) == [4, 5, 6, 40, 41]
    errors = rest.status == ResultStatus.ERROR
    assert sorted(rest.index[errors].tolist()) == [40, 41]
    assert log.undelivered("job-c") == 5
    log.delivered("job-c", rest.where)
    assert len(log.page("job-c", 100)) == 0 and log.undelivered("job-c") == 0
    everything = log.page("job-c", 5, everything=True)
    again = log.page("job-c", 5, everything.next, everything=True)
    assert sorted(everything.index.tolist() + again.index.tolist()) == [0, 1, 2, 3, 4, 5, 6, 40, 41]
    log.close()


def test_undelivered_is_counted_at_load_and_kept_without_holding_the_segments_open(data_dir):
    """A status poll of a finished job must not hold its completion segments: the collector
    removes a file only under an exclusive flock, and a client polling every 20 ms kept a
    job from ever expiring while each poll opened readers for the count."""
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    log.record(results(segs, [(first, k) for k in range(5)], size=10))
    log.record(results(segs, [(first, 5)], size=3000))  # another size class, another file
    log.sync_outputs()
    page = log.page("job-c", 2)
    log.delivered("job-c", page.where)
    log.delivered("job-c", page.where)  # a repeated acknowledgement counts nothing
    assert log.undelivered("job-c") == 4
    log.finish_job("job-c")
    log.close()

    again = CompletionLog(data_dir, segs.__getitem__)
    assert again.undelivered("job-c") == 4  # rebuilt from the markers
    assert again.load_job("job-c").readers == {}  # nothing left open by the count
    rest = again.page("job-c", 100)
    again.delivered("job-c", rest.where)
    assert again.undelivered("job-c") == 0
    again.unload("job-c")
    assert again.undelivered("job-c") == 0 and again.completed("job-c") == 6
    paths = sorted(data_dir.completion.glob("out-*"))
    assert len(paths) == 2
    for path in paths:  # no handle: an exclusive lock is free
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    again.close()


@pytest.mark.slow
def test_sigkill_mid_completion_keeps_exactly_one_result_per_retired_item(data_dir):
    segs = inputs(data_dir, n=1200)
    total = sum(s.entries for s in segs.values())
    for s in segs.values():
        s.close()
    acked: set[tuple[int, int]] = set()
    for cycle in range(20):  # four kills after each of 1..5 acknowledgements
        proc = zygote.Popen(
            [sys.executable, str(PROCS / "completion_proc.py"), str(data_dir.root), str(cycle)],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        target = 1 + cycle % 5  # kill after a different number of acknowledgements each time
        while len(lines) < target:
            line = proc.stdout.readline()  # pytest's timeout bounds a hung child
            if not line:
                break
            lines.append(line)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        for line in [*lines, *out.splitlines()]:
            if line.startswith("acked "):
                sid, *slots = map(int, line.split()[1:])
                acked.update((sid, s) for s in slots)
        recover(data_dir)
        rows = completion_rows(data_dir)
        indexes = [i for i, _ in rows]
        assert len(indexes) == len(set(indexes)), "an item has two results"
        for path in data_dir.segment_files():
            if path.name.startswith("in-"):
                with Segment.open(path) as seg:
                    dead = {(seg.segment_id, int(k)) for k in np.flatnonzero(seg.states() == DEAD)}
                    assert {a for a in acked if a[0] == seg.segment_id} <= dead, (
                        "an acknowledged retire was lost"
                    )
        assert_check_clean(data_dir)
        if len(set(indexes)) == total:
            break
    assert acked
