"""SIGKILL a writer and a retirer at random moments; nothing acknowledged may be lost.

Each cycle starts a writer process (appends batches, prints each
acknowledgement after its fdatasync) and a retirer process (tombstones
random acknowledged slots, prints each retire after its sync), lets them run
for a random number of acknowledged batches, SIGKILLs them, runs recovery,
and checks: every acknowledged seq is in the log exactly once, LIVE or DEAD,
with a good checksum; every confirmed retire is DEAD; the headers agree with
the markers; and the project's consistency check is clean.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zygote
from conftest import assert_check_clean

from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, LIVE

PROCS = Path(__file__).parent / "procs"
# 20 cycles, each killing a writer and a retirer after 1..40 acknowledged batches, at a random
# point of a random batch: 40 proved nothing more and took 40 s of CPU (bench/chaos.py and
# FABRIC_CRASH_SEED run more).
CYCLES = 20


class Child:
    """A child process whose stdout lines land in a queue (read by a thread)."""

    def __init__(self, *args: str) -> None:
        self.proc = zygote.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.endswith("\n"):  # a line cut by SIGKILL was never complete
                self.lines.put(line)

    def send(self, text: str) -> None:
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(BrokenPipeError):
                stream.close()


def log_contents(data_dir):
    """(segment, slot) -> (seq, state, checksum ok) for every written slot."""
    found = {}
    for path in data_dir.segment_files():
        with Segment.open(path) as seg:
            states = seg.states()
            written = np.flatnonzero(states)
            ok = seg.verify(written)
            for slot, seq, state, good in zip(
                written.tolist(),
                seg.slots["seq"][written].tolist(),
                states[written].tolist(),
                ok.tolist(),
                strict=True,
            ):
                found[(seg.segment_id, slot)] = (seq, state, good)
    return found


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_an_acknowledged_item(data_dir):
    rnd = random.Random(int(os.environ.get("FABRIC_CRASH_SEED", "20261130")))
    acked: dict[int, tuple[int, int]] = {}  # seq -> (segment, slot)
    retired: set[tuple[int, int]] = set()
    torn_cut = 0
    for cycle in range(CYCLES):
        writer = Child(
            str(PROCS / "segment_writer.py"), str(data_dir.root), str(cycle * 10**7 + 1), str(cycle)
        )
        retirer = Child(str(PROCS / "segment_retirer.py"), str(data_dir.root), str(cycle))
        target = rnd.randint(1, 40)
        batches = 0
        deadline = time.monotonic() + 60
        while batches < target:
            assert time.monotonic() < deadline, "writer made no progress"
            try:
                line = writer.lines.get(timeout=1)
            except queue.Empty:
                continue
            _, segment, first, count, seq = line.split()
            segment, first, count, seq = int(segment), int(first), int(count), int(seq)
            for i in range(count):
                acked[seq + i] = (segment, first + i)
            retirer.send("".join(f"{segment} {first + i}\n" for i in range(count)))
            batches += 1
        writer.kill()
        retirer.kill()
        while not writer.lines.empty():  # acks printed before the kill count too
            _, segment, first, count, seq = writer.lines.get().split()
            for i in range(int(count)):
                acked[int(seq) + i] = (int(segment), int(first) + i)
        while not retirer.lines.empty():
            _, segment, slot = retirer.lines.get().split()
            retired.add((int(segment), int(slot)))

        report = recover(data_dir, processes=2)
        assert not report.damaged
        torn_cut += report.torn()
        found = log_contents(data_dir)
        seq_counts = Counter(seq for seq, _, _ in found.values())
        for seq, place in acked.items():
            assert place in found, f"acknowledged seq {seq} at {place} is lost (cycle {cycle})"
            got_seq, state, good = found[place]
            assert got_seq == seq and state in (LIVE, DEAD) and good, (seq, place, found[place])
            assert seq_counts[seq] == 1, f"seq {seq} stored {seq_counts[seq]} times"
        for place in retired:
            assert found[place][1] == DEAD, f"confirmed retire {place} is not DEAD"
        assert_check_clean(data_dir)
    assert len(acked) > CYCLES and retired
    print(
        f"{CYCLES} kill cycles, {len(acked)} acknowledged, {len(retired)} retired, {torn_cut} torn cut"
    )
