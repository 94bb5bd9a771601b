"""Power cuts at the dangerous moments: what was acknowledged survives the machine dying.

A SIGKILL leaves the kernel's page cache behind: a write never fsynced, a file created or
renamed without an fsync of its directory, an mmap'd page never msynced all reach the disk
anyway. Here the data dir is on the power-cut file system (bench/power_fs.py), which keeps
only what was made durable; a cut (bench/power_cut.py) kills the broker and the file
system together, and the broker starts again on what survived. Each cut is armed at an
operation of the file system (the nth fsync of a segment, the rename of a job.json, ...),
which stops everything at that moment; the test waits for it, then cuts.

After each cut, every acknowledged line has exactly one outcome and `check` is clean.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from pathlib import Path

import pytest
from broker import Broker, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, skip_or_fail, wait_for

from bench.power_cut import PowerDisk, available
from ingest.submit_client import Producer
from pipeline.core.errors import FabricError

pytestmark = pytest.mark.slow


@pytest.fixture
def disk(tmp_path):
    reason = available()
    if reason:
        skip_or_fail(reason)
    disk = PowerDisk(tmp_path / "disk", tmp_path / "data").mount()
    yield disk
    disk.close()


@pytest.fixture
def powered(tmp_path, disk):
    """Start a broker on `disk` (config keywords as tests/broker.py write_config's)."""
    started = []

    def start(**config) -> PoweredBroker:
        started.append(PoweredBroker(tmp_path, disk, **config))
        return started[-1]

    yield start
    for pb in started:
        pb.close()


class PoweredBroker:
    """A broker whose data dir is a PowerDisk: started, cut, started again."""

    def __init__(self, tmp_path: Path, disk: PowerDisk, **config) -> None:
        self.tmp_path = tmp_path
        self.disk = disk
        self.config = write_config(tmp_path, data_dir=disk.mount_path, **config)
        self.lives = 0
        self.broker = self._start()

    def _start(self) -> Broker:
        self.lives += 1
        err = self.tmp_path / f"broker-{self.lives}.err"
        return Broker(self.config, stderr_path=err).start()

    def cut(self, *trees: int) -> None:
        """The power goes out (the broker and `trees` with it); the disk comes back with
        what was durable and the broker starts on it."""
        self.disk.cut(self.broker.proc.pid, *trees)
        self.broker.close()
        self.disk.mount()
        self.broker = self._start()

    def close(self) -> None:
        self.broker.close()


def outcomes(out: Path) -> Counter:
    """custom_id -> how many lines name it, across an output file and its errors file."""
    counts: Counter = Counter()
    for path in (out, out.with_name(out.name + ".errors.jsonl")):
        if path.exists():
            counts.update(json.loads(line)["custom_id"] for line in path.read_text().splitlines())
    return counts


class AckedChunks(Producer):
    """The submit client, remembering which chunks the broker acknowledged."""

    acked: set[int]

    def _await_one(self, job_id, pending, report) -> None:
        before, chunks = set(pending), report.chunks
        super()._await_one(job_id, pending, report)
        if report.chunks > chunks:
            self.acked |= before - set(pending)


def submit_in_background(pb: PoweredBroker, lines: Path, job: str) -> tuple[set, threading.Thread]:
    """Submit `lines` as `job` in a thread (50 lines a chunk) until it ends or the power
    goes; returns the set of chunks acknowledged so far (filled as acks come) and the thread."""
    producer = AckedChunks(pb.broker.address, timeout_s=2, attempts=2)
    producer.acked = set()

    def run() -> None:
        with contextlib.suppress(FabricError), producer:
            producer.submit_file(lines, job, chunk_lines=50)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return producer.acked, thread


def assert_acked_survived(pb: PoweredBroker, job: str, acked: set[int]) -> None:
    """Every chunk acknowledged before the cut is committed in the broker that came back."""
    with Producer(pb.broker.address, timeout_s=10) as producer:
        status = producer.job_status(job)
    committed = set(status.get("committed", [])) if status["exists"] else set()
    assert acked <= committed, f"acknowledged chunks lost by the cut: {sorted(acked - committed)}"


def finish_and_check(pb: PoweredBroker, job: str, lines: Path, good: set[int]) -> None:
    """Resume the submit, wait for the job, fetch every result: each good line exactly one
    output, nothing twice; then stop the broker and `check` its data dir."""
    resumed = submit(pb.config, lines, "--job-id", job)
    assert resumed.returncode == 0, resumed.stderr
    wait_for(
        lambda: pb.broker.job_status(job)["state"] == "completed", f"job {job} to complete", 60
    )
    out = pb.tmp_path / f"{job}.out.jsonl"
    fetched = run_cli("results", job, "-o", str(out), "--all", "--config", str(pb.config))
    assert fetched.returncode == 0, fetched.stderr
    counts = outcomes(out)
    expected = {f"r{i}" for i in good}
    assert not (expected - set(counts)), f"lost: {sorted(expected - set(counts))[:5]}"
    doubled = [c for c, n in counts.items() if n > 1 and c is not None]  # None: broken JSON
    assert not doubled, f"two outcomes: {doubled[:5]}"
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


# Where the power goes while lines are submitted and served: (op, path glob, nth, when).
INGEST_MOMENTS = {
    "mid group commit": ("fsync", "segments/in-*", 3, "before"),
    "between the fdatasync and the CHUNK_ACK": ("fsync", "segments/in-*", 3, "after"),
    "the chunk journal's commit": ("fsync", "jobs/j/chunks.log", 3, "after"),
    "a new segment's name": ("fsyncdir", "segments", 2, "before"),
    "a new segment renamed into place": ("rename", "segments/in-*", 2, "after"),
    "job.json renamed": ("rename", "jobs/j/job.json", 1, "after"),
    "the job's directory": ("fsyncdir", "jobs", 1, "after"),
    "a completion segment's sync": ("fsync", "completion/out-*", 2, "after"),
    "completion tombstones": ("fsync", "segments/in-*", 12, "after"),
    "the job's finished mark": ("rename", "jobs/j/finished*", 1, "before"),
}


@pytest.mark.parametrize("moment", INGEST_MOMENTS)
def test_a_cut_while_lines_are_submitted_and_served_loses_no_acknowledged_line(
    tmp_path, disk, powered, moment
):
    pb = powered(workers=1, segment_bytes=1 << 20)
    lines = tmp_path / "in.jsonl"
    good = write_jsonl(lines, 300, seed=1, bad_every=40)
    op, glob, nth, when = INGEST_MOMENTS[moment]
    disk.arm(op, glob, nth, when)
    acked, client = submit_in_background(pb, lines, "j")
    wait_for(disk.fired, f"the moment: {moment}")
    acked_before_cut = set(acked)  # nothing more is acknowledged: nothing more is durable
    pb.cut()
    assert_acked_survived(pb, "j", acked_before_cut)
    finish_and_check(pb, "j", lines, good)
    client.join(timeout=30)
