"""Property-based: random append / sync / tombstone / rotate / crash-and-recover sequences
against a simple model of what the log must hold."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from conftest import appender, fuzz_examples, make_batch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from assembly.check import check_data_dir
from pipeline.store.datadir import DataDir
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, LIVE


class SegmentLogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="fabric-model-")
        self.data_dir = DataDir(self.root).ensure()
        self.log = appender(self.data_dir, segment_bytes=1 << 16)  # ~200 slots a segment
        self.rng = np.random.default_rng(0)
        self.next_seq = 1
        self.state: dict[int, int] = {}  # seq -> LIVE or DEAD: the model
        self.place: dict[int, tuple[int, int]] = {}  # seq -> (segment id, slot)
        self.open: dict[int, Segment] = {}

    def teardown(self) -> None:
        for seg in self.open.values():
            seg.close()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _segment(self, segment_id: int) -> Segment:
        if segment_id not in self.open:
            path = next(
                p for p in self.data_dir.segment_files() if f"-{segment_id:012d}." in p.name
            )
            self.open[segment_id] = Segment.open(path, writable=True)
        return self.open[segment_id]

    @rule(n=st.integers(1, 450))
    def append(self, n: int) -> None:
        placed = self.log.append(*make_batch(self.rng, n, self.next_seq))
        seq = self.next_seq
        for segment, first, count in placed.tolist():
            for i in range(count):
                self.place[seq + i] = (segment, first + i)
                self.state[seq + i] = LIVE
            seq += count
        self.next_seq = seq

    @rule()
    def sync(self) -> None:
        self.log.sync()

    @rule(fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
    @precondition(lambda self: self.state)
    def tombstone(self, fraction: float, seed: int) -> None:
        chosen = [s for s in self.state if np.random.default_rng(seed + s).random() < fraction]
        by_segment: dict[int, list[int]] = {}
        for seq in chosen:
            segment, slot = self.place[seq]
            by_segment.setdefault(segment, []).append(slot)
            self.state[seq] = DEAD
        for segment, slots in by_segment.items():
            self._segment(segment).tombstone(np.array(slots))

    @rule(idle=st.booleans())
    def rotate(self, idle: bool) -> None:
        current = self.log.current
        if current is not None:
            self.log.maybe_rotate(current.last_append_s + (1e9 if idle else 0.0))

    @rule()
    def crash_and_recover(self) -> None:
        for seg in self.open.values():
            seg.close()
        self.open.clear()
        self.log = appender(self.data_dir, segment_bytes=1 << 16)  # the old one is simply dropped
        report = recover(self.data_dir, processes=1)
        assert not report.damaged and report.torn() == 0
        live = sum(1 for v in self.state.values() if v == LIVE)
        assert report.live == live
        for summary in report.segments:
            seqs = [s for s, (seg, _) in self.place.items() if seg == summary.segment_id]
            model_live = sorted(self.place[s][1] for s in seqs if self.state[s] == LIVE)
            assert summary.live == len(model_live)
            assert summary.dead == len(seqs) - len(model_live)
            assert summary.first_live == (model_live[0] if model_live else -1)
            assert summary.sealed and summary.finished == (not model_live)
        report = check_data_dir(self.data_dir)
        assert report.clean, [f.line() for f in report.remaining]

    @invariant()
    def log_matches_model(self) -> None:
        if not self.state or self.rng.random() > 0.3:  # reading everything each step is slow
            return
        for seq, (segment, slot) in self.place.items():
            seg = self._segment(segment)
            assert int(seg.slots["seq"][slot]) == seq
            assert int(seg.markers[slot] & 0xFF) == self.state[seq]


TestSegmentLog = SegmentLogMachine.TestCase
TestSegmentLog.settings = settings(
    max_examples=fuzz_examples(30),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
