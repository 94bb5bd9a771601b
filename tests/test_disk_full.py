"""A real full disk: a size-limited tmpfs under the data dir, filled by appends and by a
ballast file while a real broker ingests and completes jobs (skipped without root)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pytest
from broker import REPO, Broker, seq_counts, submit, write_config
from client_commands import run_cli
from conftest import appender, assert_check_clean, make_batch, small_tmpfs, wait_for

from collector.completion.record_format import FIRST_SEGMENT_BYTES
from collector.results_client import ResultsClient
from config.stage_settings import stage_settings
from ingest.jobs import JobRegistry
from ingest.submit_client import Producer
from pipeline.core.errors import DiskFullError
from pipeline.store.datadir import DataDir
from pipeline.store.disk_full import FullDisk
from pipeline.store.recovery import recover
from pipeline.store.segment import Segment
from pipeline.store.segment_append import capacity_for
from pipeline.store.segment_format import LIVE, slot_bytes_for


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


# ---- the stages' state machine ---------------------------------------------------------------
def test_a_full_disk_is_logged_once_tried_once_a_second_and_its_end_said_once(caplog):
    caplog.set_level(logging.INFO, "test.disk_full")
    disk = FullDisk(logging.getLogger("test.disk_full"), "results wait", calm_s=10, remind_s=60)
    full = DiskFullError("/x/out-1.seg: disk full while creating a segment")
    assert disk.ready(0.0)
    disk.failed(full, 0.0)
    assert not disk.ready(0.5) and disk.ready(1.0) and not disk.ready(1.9)
    for t in range(2, 30):  # a message a second, each one tried and failing: no more lines
        assert disk.ready(float(t))
        disk.failed(full, float(t))
        disk.refused()
    for t in (30.0, 32.0, 34.0):  # flapping: one write fits, the next does not
        disk.succeeded(t)
        assert disk.ready(t + 0.1) and disk.ready(t + 0.2)  # writable: every write is tried
        disk.failed(full, t + 1)
    disk.succeeded(36.0)
    disk.settle(45.9)  # not yet calm for 10 s
    assert disk.figures("x-0")["fabric_disk_full"] == {("x-0",): 1}
    disk.settle(46.0)  # one episode, one end
    assert disk.figures("x-0") == {
        "fabric_disk_full": {("x-0",): 0},
        "fabric_disk_full_episodes_total": {("x-0",): 1},
    }
    disk.failed(full, 50.0)  # a new episode
    disk.failed(full, 111.0)  # a minute on, still full: one reminder
    assert disk.figures("x-0")["fabric_disk_full_episodes_total"] == {("x-0",): 2}
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["ERROR", "INFO", "ERROR", "ERROR"]
    assert "disk full: /x/out-1.seg" in lines[0][1] and "results wait" in lines[0][1]
    assert "writable again after 36.0 s (failed tries: 32, turned away: 28)" in lines[1][1]
    assert "disk still full after 61 s" in lines[3][1]


def test_a_job_cannot_be_created_on_a_full_disk_retryably_and_can_once_space_is_freed(small_fs):
    registry = JobRegistry(small_fs / "fabric")
    registry.create("first", 100)
    fill(small_fs / "ballast", leave_bytes=0)
    with pytest.raises(DiskFullError, match="disk full while creating the job") as caught:
        registry.create("second", 100)
    assert caught.value.retryable and not (small_fs / "fabric/jobs/second/job.json").exists()
    (small_fs / "ballast").unlink()
    assert registry.create("second", 100).job_no > registry.get("first").job_no
    registry.close()


# ---- a real broker on a small disk -------------------------------------------------------------
MIB = 1 << 20
TOKENS = 64  # every item in lane 64: 288-byte slots, one input segment key
SEGMENT_BYTES = 4 * MIB  # tests/broker.py: about 14,300 items of lane 64 per input segment


def fill(path: Path, leave_bytes: int) -> None:
    """A ballast file that leaves about `leave_bytes` free on its file system (0: none at all)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        room = shutil.disk_usage(path.parent).free - leave_bytes
        if room > 0:
            os.posix_fallocate(fd, os.fstat(fd).st_size, room)
        if leave_bytes == 0:  # the last pages too, until the file system says no
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(4096))
    finally:
        os.close(fd)


def write_items(path: Path, prefix: str, n: int) -> set[str]:
    """n embedding lines for `echo`, each exactly TOKENS token ids; returns their custom_ids."""
    with open(path, "wb") as out:
        for i in range(n):
            tokens = list(range(1 + i % 1000, 1 + i % 1000 + TOKENS))
            body = {"model": "echo", "prompt_token_ids": tokens}
            line = {"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/embeddings"}
            out.write(orjson.dumps({**line, "body": body}) + b"\n")
    return {f"{prefix}{i}" for i in range(n)}


def run_py(config: Path, *args: str) -> subprocess.CompletedProcess:
    """`run.py ARGS --config CONFIG`, run in this process (tests/client_commands.py)."""
    return run_cli(*args, "--config", str(config))


def results_once(config: Path, job: str, out: Path) -> Counter:
    """`results JOB -o OUT`: custom_id -> lines written (output and error files)."""
    fetched = run_py(config, "results", job, "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    counts: Counter = Counter()
    for path in (out, Path(f"{out}.errors.jsonl")):
        if path.exists():
            counts.update(
                orjson.loads(line)["custom_id"] for line in path.read_bytes().splitlines()
            )
    return counts


@pytest.fixture
def broker_on_small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "192m") as mount_point:
        config = write_config(tmp_path, workers=1, data_dir=mount_point / "fabric")
        broker = Broker(config, stderr_path=tmp_path / "broker.err")  # logging fails there
        try:
            yield broker.start(), mount_point
        finally:
            broker.close()


def test_a_full_disk_during_ingest_and_completion_stops_nothing_loses_nothing_and_resumes(
    tmp_path, broker_on_small_disk
):
    b, disk = broker_on_small_disk
    config = b.config
    started = b.pids()
    status = ResultsClient(b.settings.completion.bind, timeout_s=10)
    ingest = Producer(b.address, timeout_s=10)
    try:
        # (a) Ingest: room for one input segment, not two (and no completion segment at all).
        wanted_a = write_items(tmp_path / "a.jsonl", "a", 20_000)
        submit_a = [sys.executable, "run.py", "submit", str(tmp_path / "a.jsonl"), "--job-id", "a"]
        fill(disk / "ballast", leave_bytes=SEGMENT_BYTES + 3 * MIB)
        err_a = tmp_path / "submit-a.err"
        with open(err_a, "w") as err:
            producer = subprocess.Popen(
                [*submit_a, "--config", str(config), "--attempts", "40"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=REPO,
            )

        def tries() -> int:
            """The highest try of a chunk that submit reported as not stored yet."""
            return max(
                map(int, re.findall(r"not stored yet \(try (\d+) of", err_a.read_text())), default=0
            )

        wait_for(
            lambda: tries() and "disk full while creating a segment" in err_a.read_text(),
            "submit to hear (retryably) that the broker's disk is full",
            timeout_s=60,
            interval_s=0.1,
        )
        acknowledged = ingest.job_status("a")["stored"]
        in_log = seq_counts(b.data_dir)
        assert 0 < acknowledged <= len(in_log) < len(wanted_a)  # one segment's worth, no more
        assert set(in_log.values()) == {1}
        # Now truly full: the job journal, the dispatch file and the logs fail too.
        fill(disk / "ballast-2", leave_bytes=0)
        before = tries()
        wait_for(lambda: tries() >= before + 3, "submit to go on retrying", timeout_s=30)
        assert producer.poll() is None  # still trying, not given up
        assert ingest.job_status("a")["stored"] == acknowledged  # the front answers reads
        # completion answers; it stored at most what was acknowledged (its first, small segments
        # may have fit in the room the input segment left)
        assert status.job_status("a")["completed"] <= acknowledged
        (disk / "ballast").unlink()
        (disk / "ballast-2").unlink()
        out, _ = producer.communicate(timeout=90)
        assert producer.returncode == 0, err_a.read_text()[-2000:]
        assert out.strip() == "a"
        wait_for(
            lambda: status.job_status("a")["state"] == "completed",
            "job a to complete (workers sent their unacknowledged results again)",
            timeout_s=60,
            interval_s=0.2,
        )
        assert set(seq_counts(b.data_dir).values()) <= {1}  # nothing stored twice
        completion_log = b.data_dir.log / "completion-0.log"
        episodes = lambda: b.metric("fabric_disk_full_episodes_total", stage="completion-0")  # noqa: E731
        wait_for(  # writable for CALM_S (10 s): the episode is over, the next one is a new one
            lambda: b.metric("fabric_disk_full", stage="completion-0") == 0 and episodes() == 1,
            "completion's full-disk episode to end",
            timeout_s=30,
            interval_s=0.2,
        )
        # The broker frees space of its own: job a's first input segment (every slot retired)
        # goes at the collector's next sweep. Gone before the disk fills again, or it could
        # make room for b's results in the middle of (b) and there would be no full disk.
        wait_for(
            lambda: len(list(b.data_dir.segments.glob("in-*.seg"))) == 1,
            "the collector to remove job a's finished input segment (the open one stays)",
            timeout_s=30,
            interval_s=0.2,
        )

        # (b) Completion: job b is queued; then the disk fills before its results come back.
        wanted_b = write_items(tmp_path / "b.jsonl", "b", 2_000)
        worker = started["worker-0"]
        os.kill(worker, signal.SIGSTOP)
        try:
            queued = submit(config, tmp_path / "b.jsonl", "--job-id", "b")
            assert queued.returncode == 0, queued.stderr
            # < one completion segment (they start at 256 KiB: collector/completion/results_log.py)
            fill(disk / "ballast", leave_bytes=128 * 1024)
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_for(
            lambda: episodes() == 2 and b.metric("fabric_disk_full", stage="completion-0") == 1,
            "completion to find the disk full once more (a new episode)",
            timeout_s=60,
        )
        # The broker may free a little space of its own meanwhile (dispatch compacts its in-flight
        # log): then b's first, smallest completion segment can fit, but never more, and b cannot
        # finish while the disk is full.
        first_segment = capacity_for(FIRST_SEGMENT_BYTES, slot_bytes_for(1024))
        info = status.job_status("b")  # status reads go on
        assert info["state"] in ("queued", "in_progress") and info["total"] == 2_000
        assert info["completed"] <= first_segment
        delivered_a = results_once(config, "a", tmp_path / "a.out.jsonl")  # and results reads
        assert set(delivered_a) == wanted_a and set(delivered_a.values()) == {1}
        assert status.job_status("b")["completed"] <= first_segment  # no more of b meanwhile
        (disk / "ballast").unlink()
        wait_for(
            lambda: status.job_status("b")["state"] == "completed",
            "job b to complete once space is free",
            timeout_s=60,
            interval_s=0.2,
        )
        delivered_b = results_once(config, "b", tmp_path / "b.out.jsonl")
        assert set(delivered_b) == wanted_b and set(delivered_b.values()) == {1}
    finally:
        status.close()
        ingest.close()
    assert b.pids() == started  # no stage restarted, none stopped
    lines = completion_log.read_text()
    # One ERROR line per episode (those two), not one per message refused; each end said once.
    assert lines.count(" ERROR ") == lines.count("disk full: ") == 2, lines
    assert lines.count("disk writable again") >= 1, lines
    assert b.stop() == 0, b.stderr[-2000:]
    assert_check_clean(b.data_dir)


def test_the_writer_ends_a_full_disk_episode_once_space_is_freed_with_nothing_more_to_write(
    tmp_path,
):
    """The last failed write is never tried again (a retried chunk whose items an earlier try
    placed is not appended anew): the writer must find out by itself that the disk has room."""
    from config import load_settings
    from pipeline.store.disk_full import CALM_S, RETRY_S
    from router.writer_stage import WriterStage

    settings = load_settings(None, {"broker": {"data_dir": str(tmp_path / "fabric")}})
    stage = WriterStage(stage_settings(settings, "writer"), 0)
    stage.open()
    try:
        start = time.monotonic()
        stage.disk.failed(DiskFullError("disk full while syncing (test)"), start)
        now = start
        while now < start + RETRY_S + CALM_S + 2 and stage.disk.episode:
            stage.step(now)
            now += 0.5
        assert not stage.disk.episode, "the writer never saw that the disk has room again"
        assert not stage.disk.full
        assert list(stage.data_dir.segments.glob(".*probe")) == []
    finally:
        stage.close()
