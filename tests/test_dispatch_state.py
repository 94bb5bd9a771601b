"""The dispatch owner's state against real segment files, driven one call at a time."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.dispatch.state import DispatchState
from pipeline.core import item_seq
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, KIND_INPUT, SegmentKey, slot_bytes_for

LANE = 64


def segment(data_dir, segment_id: int, n: int, model: str = "m", seq0: int = 1) -> Segment:
    key = SegmentKey(KIND_INPUT, model, 1, LANE)
    seg = Segment.create(data_dir.segments, segment_id, key, slot_bytes_for(LANE * 4), 1000)
    seg.append(*make_batch(np.random.default_rng(segment_id), n, seq0))
    return seg


def job_segment(data_dir, segment_id: int, n: int, job_no: int = 9) -> Segment:
    """Like `segment`, with seqs as ingest makes them: job_no << 32 | index."""
    key = SegmentKey(KIND_INPUT, "m", 1, LANE)
    seg = Segment.create(data_dir.segments, segment_id, key, slot_bytes_for(LANE * 4), 1000)
    _, _, _, counts, tokens = make_batch(np.random.default_rng(segment_id), n, 1)
    index = np.arange(n, dtype=np.uint32)
    seq = item_seq.seq_of(job_no, index)
    seg.append(seq, np.full(n, job_no, np.uint64), index, counts, tokens)
    return seg


def state(*segments: Segment, lease_s: float = 10.0, max_attempts: int = 3) -> DispatchState:
    s = DispatchState(lease_s, max_attempts)
    for seg in segments:
        s.add_segment(seg, 0, seg.entries)
    s.loaded()
    return s


def test_a_batch_is_one_segment_oldest_first_with_its_tokens(data_dir):
    old, new = segment(data_dir, 1, 10), segment(data_dir, 2, 10, seq0=100)
    s = state(new, old)
    batch = s.next_batch("w1", "m", max_items=4, max_tokens=10_000, now=0.0)
    assert batch.segment_id == 1 and batch.items["slot"].tolist() == [0, 1, 2, 3]
    assert batch.tokens.shape == (4, LANE)
    assert np.array_equal(batch.tokens, old.words[:4, 8:])
    assert np.array_equal(batch.lengths, old.slots["count"][:4])
    assert batch.items["seq"].tolist() == [1, 2, 3, 4]
    tokens_budget = s.next_batch("w1", "m", max_items=100, max_tokens=3 * LANE, now=0.0)
    assert tokens_budget.items["slot"].tolist() == [4, 5, 6]
    assert s.next_batch("w1", "other-model", 10, 10_000, 0.0) is None


def test_priority_first_and_hints_reorder_but_never_veto(data_dir):
    low, high = segment(data_dir, 1, 5), segment(data_dir, 2, 5)
    s = DispatchState(10.0, 3)
    s.add_segment(low, 0, 5, priority=0)
    s.add_segment(high, 0, 5, priority=5)
    assert s.next_batch("w", "m", 5, 10_000, 0.0).segment_id == 2
    assert (
        s.next_batch("w", "m", 5, 10_000, 0.0, prefer=[99, 2]).segment_id == 1
    )  # 2 is empty: fall through


def test_nothing_is_handed_out_twice_and_retired_slots_never_return(data_dir):
    seg = segment(data_dir, 1, 10)
    s = state(seg)
    first = s.next_batch("a", "m", 6, 10_000, 0.0)
    second = s.next_batch("b", "m", 6, 10_000, 0.0)
    assert set(first.items["slot"]).isdisjoint(second.items["slot"]) and len(second.items) == 4
    assert s.next_batch("c", "m", 6, 10_000, 0.0) is None
    seg.tombstone(first.items["slot"])
    s.retired(1, first.items["slot"])
    assert s.reclaim(second.batch_id, count_attempt=False) == 4
    again = s.next_batch("c", "m", 10, 10_000, 0.0)
    assert again.items["slot"].tolist() == second.items["slot"].tolist()
    assert len(s.leases()) == 1


def test_leases_expire_only_after_loading_and_rewind_with_an_attempt(data_dir):
    seg = segment(data_dir, 1, 10)
    s = DispatchState(lease_s=5.0, max_attempts=2)  # so the next try is the last one
    s.add_segment(seg, 0, 10)
    batch = s.next_batch("a", "m", 4, 10_000, now=0.0)
    assert s.expire(now=100.0) == 0  # recovery not finished: no timeouts (invariant 9)
    s.loaded()
    s.renew("a", now=100.0)
    assert s.expire(now=104.0) == 0
    assert s.expire(now=106.0) == 4
    assert seg.attempts(batch.items["slot"]).tolist() == [1, 1, 1, 1]
    with Segment.open(seg.path) as reader:  # the attempts byte is in the file, markers still LIVE
        assert reader.attempts(np.arange(4)).tolist() == [1, 1, 1, 1]
        assert (reader.states()[:4] == 1).all()
    rerun = s.next_batch("b0", "m", 10, 10_000, now=106.0)
    assert rerun.items["slot"].tolist() == [0]  # the reclaimed ones first, oldest first, alone
    assert s.next_batch("b0", "m", 10, 10_000, now=106.0) is None  # nothing else for b0 meanwhile
    for slot in (1, 2, 3):  # an item that failed before goes alone: a poison item sinks no batch
        batch = s.next_batch(f"b{slot}", "m", 10, 10_000, now=106.0)
        assert batch.items["slot"].tolist() == [slot]
    assert s.next_batch("c", "m", 10, 10_000, now=106.0).items["slot"].tolist() == list(
        range(4, 10)
    )
    assert s.next_batch("c", "m", 10, 10_000, now=106.0) is None  # a retried one waits for c
    s.retired(1, np.array([0]))
    seg.tombstone(np.array([0]))
    assert s.next_batch("b0", "m", 10, 10_000, now=106.0) is None  # nothing left to give


def test_an_item_reclaimed_max_attempts_times_is_dead_lettered(data_dir):
    seg = segment(data_dir, 1, 3)
    s = state(seg, max_attempts=2)
    for attempt in range(2):
        batch = s.next_batch(f"w{attempt}", "m", 1, 10_000, 0.0)
        assert batch.items["slot"].tolist() == [0]
        s.drop_session(f"w{attempt}")  # the worker died holding it
    outcome = s.take_outcomes()
    assert outcome.dead_letters["slot"].tolist() == [0] and outcome.dead_letters[
        "seq"
    ].tolist() == [1]
    assert s.next_batch("w9", "m", 5, 10_000, 0.0).items["slot"].tolist() == [1, 2]


def test_a_slot_that_fails_its_checksum_is_quarantined_never_sent(data_dir):
    seg = job_segment(data_dir, 1, 5)
    seg.bodies[2, 3] ^= 0x40
    s = state(seg)
    batch = s.next_batch("w", "m", 5, 10_000, 0.0)
    assert batch.items["slot"].tolist() == [0, 1, 3, 4]
    assert s.take_outcomes().quarantined["slot"].tolist() == [2]
    s.reclaim(batch.batch_id, count_attempt=False)
    assert 2 not in s.next_batch("w", "m", 5, 10_000, 0.0).items["slot"].tolist()


def test_a_batch_can_be_handed_back_in_part(data_dir):
    seg = segment(data_dir, 1, 6)
    s = state(seg)
    batch = s.next_batch("w", "m", 6, 10_000, 0.0)
    assert s.reclaim(batch.batch_id, count_attempt=False, slots=np.array([4, 5])) == 2
    assert s.leases()[0].items["slot"].tolist() == [0, 1, 2, 3]
    assert s.next_batch("v", "m", 6, 10_000, 0.0).items["slot"].tolist() == [4, 5]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "retire", "back", "expire", "drop"]), st.integers(1, 7)),
        max_size=40,
    )
)
def test_random_operations_never_lease_a_slot_twice_or_lose_one(tmp_path_factory, ops):
    from pipeline.store.datadir import DataDir

    data_dir = DataDir(tmp_path_factory.mktemp("d")).ensure()
    seg = segment(data_dir, 1, 30)
    s = DispatchState(lease_s=1.0, max_attempts=3)
    s.add_segment(seg, 0, 30)
    s.loaded()
    now = 0.0
    for op, k in ops:
        now += 0.3
        leases = s.leases()
        if op == "take":
            s.next_batch(f"w{k % 3}", "m", k, 10_000, now)
        elif op == "retire" and leases:
            batch = leases[k % len(leases)]
            seg.tombstone(batch.items["slot"][:k])
            s.retired(1, batch.items["slot"][:k])
        elif op == "back" and leases:
            s.reclaim(leases[k % len(leases)].batch_id, count_attempt=bool(k % 2))
        elif op == "expire":
            s.expire(now)
        elif op == "drop":
            s.drop_session(f"w{k % 3}")
        out = np.concatenate([b.items["slot"] for b in s.leases()] or [np.zeros(0, np.uint32)])
        assert len(out) == len(set(out.tolist())), "a slot is on two leases"
        assert ((seg.markers[out.astype(np.int64)] & 0xFF) != DEAD).all(), (
            "a retired slot is leased"
        )
    outcome = s.take_outcomes()
    gone = set(outcome.dead_letters["slot"].tolist())
    final = 0
    while (batch := s.next_batch(f"final{final}", "m", 100, 10_000, now)) is not None:
        final += 1  # a retried item goes alone to a session holding nothing: use fresh ones
    held = {int(x) for b in s.leases() for x in b.items["slot"]}
    live = {int(i) for i in np.flatnonzero((seg.markers[:30] & 0xFF) == 1)}
    assert live <= held | gone, f"LIVE slots never offered again: {sorted(live - held - gone)}"


def test_unknown_segment_retire_is_ignored(data_dir):
    s = DispatchState(1.0, 3)
    s.retired(42, np.array([1]))
    with pytest.raises(KeyError):
        s.extend(42, 10)


def test_only_batches_a_worker_may_have_started_count_an_attempt_when_it_dies(data_dir):
    seg = segment(data_dir, 1, 12)
    s = state(seg, max_attempts=3)
    running = s.next_batch("w", "m", 4, 10_000, 0.0)
    queued = s.next_batch("w", "m", 4, 10_000, 0.0)
    held = np.concatenate([running.items, queued.items])
    s.report("w", held, seen_batch=queued.batch_id, now=1.0, queued=[queued.batch_id])
    assert s.drop_session("w") == 8
    assert seg.attempts(np.arange(8)).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_a_last_try_goes_alone_and_its_session_gets_more_once_it_survived(data_dir):
    seg = segment(data_dir, 1, 6)
    s = state(seg, max_attempts=3)
    seg.set_attempts(np.array([0]), np.array([2]))  # slot 0 failed twice already
    alone = s.next_batch("w", "m", 10, 10_000, 0.0)
    assert alone.items["slot"].tolist() == [0] and alone.suspect
    assert s.next_batch("w", "m", 10, 10_000, 0.0) is None  # nothing else while it runs
    s.answered("w", alone.batch_id)  # its results came back: the worker lived through it
    assert s.next_batch("w", "m", 10, 10_000, 0.0).items["slot"].tolist() == [1, 2, 3, 4, 5]


def test_answered_batches_stop_counting_against_a_session_budget(data_dir):
    seg = segment(data_dir, 1, 10)
    s = state(seg)
    first = s.next_batch("w", "m", 2, 10_000, 0.0)
    s.next_batch("w", "m", 2, 10_000, 0.0)
    assert s.session_batches("w") == 2
    s.answered("w", first.batch_id)
    s.answered("other", first.batch_id + 1)  # only the holder's word counts
    assert s.session_batches("w") == 1 and len(s.leases("w")) == 2  # still leased until retired


def test_a_marker_in_no_known_state_is_never_sent_even_if_its_low_byte_reads_live(data_dir):
    seg = segment(data_dir, 1, 5)
    seg.markers[1] = 0x0001_0001  # state byte LIVE, upper bytes set: no known state
    seg.markers[3] = 0x0100_0101  # LIVE, 1 attempt, a stray top byte
    seg.markers[4] = 0x0000_0101  # LIVE with 1 attempt: known, dispatchable
    s = state(seg)
    batch = s.next_batch("w", "m", 5, 10_000, 0.0)
    assert batch.items["slot"].tolist() == [0, 2, 4]
    assert s.next_batch("v", "m", 5, 10_000, 0.0) is None


def test_a_corrupt_slot_that_does_not_say_which_item_it_holds_blames_no_item(data_dir):
    seg = job_segment(data_dir, 1, 4)
    seq = seg.slots["seq"][:4].copy()
    seg.bodies[1, 5] ^= 0x01  # a token rots: the header still names item 1 of job 9
    seg.slots["seq"][2] ^= np.uint64(1 << 33)  # the seq rots: it would name job 11
    s = state(seg)
    batch = s.next_batch("w", "m", 4, 10_000, 0.0)
    assert batch.items["slot"].tolist() == [0, 3]
    quarantined = s.take_outcomes().quarantined
    assert quarantined["slot"].tolist() == [1] and quarantined["seq"].tolist() == [int(seq[1])]


def test_cancelled_items_leave_the_queue_depth_and_stay_out_once_retired(data_dir):
    """Issue 30 point 9: a cancelled job's queued items left the count when cancelled and came
    back once retired (RETIRED cleared their `out` flags); a state loaded from the segment
    after a restart counted them again too (their markers DEAD past the first LIVE slot)."""
    key = SegmentKey(KIND_INPUT, "m", 1, LANE)
    seg = Segment.create(data_dir.segments, 1, key, slot_bytes_for(LANE * 4), 1000)
    _, _, _, counts, tokens = make_batch(np.random.default_rng(1), 400, 1)
    jobs = np.where(np.arange(400) % 2 == 0, 5, 6).astype(np.uint64)  # jobs 5 and 6 interleaved
    index = np.arange(400, dtype=np.uint32) // 2
    seg.append(item_seq.seq_of(jobs, index), jobs, index, counts, tokens)
    s = state(seg)

    def waiting(s: DispatchState) -> int:
        return sum(q.waiting for q in s.queue_depth())

    assert waiting(s) == 400
    assert s.cancel_job(6) == 200
    assert waiting(s) == 200
    cancelled = s.take_outcomes().cancelled
    seg.tombstone(cancelled["slot"].astype(np.int64))  # completion stores their errors
    s.retired(1, cancelled["slot"].astype(np.int64))
    assert waiting(s) == 200
    batch = s.next_batch("w", "m", max_items=10, max_tokens=10**6, now=0.0)
    assert item_seq.job_of(batch.items["seq"]).tolist() == [5] * 10
    assert waiting(s) == 190
    assert waiting(state(seg)) == 200  # the next life: nothing on lease, the DEAD stay out
