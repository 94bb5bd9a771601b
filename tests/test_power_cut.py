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
import os
import struct
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import zygote
from broker import REPO, Broker, free_port, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, skip_or_fail, wait_for

from bench.power_cut import PowerDisk, available
from collector.delivery.result_file import ResultFile
from ingest.submit_client import Producer
from pipeline.core.errors import FabricError
from pipeline.store.records import RecordLog, read_records
from pipeline.store.segment_format import ENTRIES_OFFSET, HEADER_BYTES, parse_header

pytestmark = pytest.mark.slow

# After a start dispatch waits this long for workers that still hold work to come back
# (5 s by default); a power cut takes the local workers with the broker, so no one comes.
SHORT_GRACE = "reregister_grace_s = 0.5"


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

    def __init__(self, tmp_path: Path, disk: PowerDisk, endpoints: str = "", **config) -> None:
        """`endpoints`: a TOML list of the urls the models serve (else embeddings only).
        Dispatch waits `SHORT_GRACE` after each start for workers still holding work: its
        only workers are local ones, which die with the power."""
        self.tmp_path = tmp_path
        self.disk = disk
        config.setdefault("dispatch", SHORT_GRACE)
        self.config = write_config(tmp_path, data_dir=disk.mount_path, **config)
        if endpoints:
            text = self.config.read_text()
            self.config.write_text(text.replace('["/v1/embeddings"]', endpoints))
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

    def cut_while_starting(self, op: str, glob: str, nth: int = 1, when: str = "after") -> dict:
        """The power goes out; the broker starts again on what survived, and the power goes
        out again at the armed moment of that start (bench/power_cut.py `arm`); then the
        broker starts once more. Returns the first cut's counts (`PowerDisk.cut`)."""
        first = self.disk.cut(self.broker.proc.pid)
        self.broker.close()
        self.disk.mount()
        self.start_until_cut(op, glob, nth, when)
        return first

    def start_until_cut(self, op: str, glob: str, nth: int = 1, when: str = "after") -> None:
        """Start the broker (stopped, or cut) and cut the power at the armed moment of that
        start (bench/power_cut.py `arm`); then start it once more on what survived."""
        self.disk.arm(op, glob, nth, when)
        self.lives += 1
        err = self.tmp_path / f"broker-{self.lives}.err"
        self.broker = Broker(self.config, stderr_path=err)
        starting = threading.Thread(target=self._start_until_cut, daemon=True)
        starting.start()
        wait_for(self.disk.fired, f"the {op} of {glob} while the broker starts")
        self.disk.cut(self.broker.proc.pid)
        starting.join(timeout=90)
        self.broker.close()
        self.disk.mount()
        self.broker = self._start()

    def _start_until_cut(self) -> None:
        with contextlib.suppress(AssertionError, TimeoutError):  # the power went out
            self.broker.start()

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


def assert_acked_survived(pb: PoweredBroker, job: str, acked: set[int], moment: str = "") -> None:
    """Every chunk acknowledged before the cut (at `moment`) is committed in the broker that
    came back."""
    with Producer(pb.broker.address, timeout_s=10) as producer:
        status = producer.job_status(job)
    committed = set(status.get("committed", [])) if status["exists"] else set()
    lost = sorted(acked - committed)
    assert not lost, f"acknowledged chunks of {job} lost by the cut at {moment!r}: {lost}"


def fetch_and_check(pb: PoweredBroker, job: str, good: set[int]) -> None:
    """Wait for the job and fetch every result: each good line exactly one outcome, nothing
    twice."""
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


def finish_and_check(pb: PoweredBroker, job: str, lines: Path, good: set[int]) -> None:
    """Resume the submit, wait for the job, fetch every result (`fetch_and_check`); then stop
    the broker and `check` its data dir."""
    resumed = submit(pb.config, lines, "--job-id", job)
    assert resumed.returncode == 0, resumed.stderr
    fetch_and_check(pb, job, good)
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


# Where the power goes while lines are submitted, then while they are served: (op, path glob,
# nth, when); `{job}` is the job's id. Each group runs on one broker and one disk, a job per
# moment: submitted until the moment, cut, the broker back, the acknowledged chunks checked,
# the submit resumed; then every job served and fetched, each line once, and `check`.
SUBMIT_MOMENTS = {  # the first on a fresh disk: a life goes on filling the last one's segments
    "a new segment's name": ("fsyncdir", "segments", 2, "before"),
    "mid group commit": ("fsync", "segments/in-*", 3, "before"),
    "between the fdatasync and the CHUNK_ACK": ("fsync", "segments/in-*", 3, "after"),
    "the chunk journal's commit": ("fsync", "jobs/{job}/chunks.log", 3, "after"),
    "job.json renamed": ("rename", "jobs/{job}/job.json", 1, "after"),
    "the job's directory": ("fsyncdir", "jobs", 1, "after"),
}
SERVE_MOMENTS = {  # the first on a fresh disk: a life goes on filling the last one's segments
    "a new segment renamed into place": ("rename", "segments/in-*", 2, "after"),
    "a completion segment's sync": ("fsync", "completion/out-*", 2, "after"),
    "completion tombstones": ("fsync", "segments/in-*", 12, "after"),
    "the job's finished mark": ("rename", "jobs/{job}/finished*", 1, "before"),
    "a dispatch file sync": ("fsync", "dispatch/inflight.log", 1, "after"),
}


@pytest.mark.parametrize("moments", [SUBMIT_MOMENTS, SERVE_MOMENTS], ids=["submit", "serve"])
def test_cuts_while_lines_are_submitted_and_served_lose_no_acknowledged_line(
    tmp_path, disk, powered, moments
):
    """Submit moments run with no worker (nothing served, so no tombstone or collector
    syncs count toward an armed moment) and each job is resumed only after the last cut;
    then a worker serves every job. Serve moments run with one, each job resumed and served
    before the next moment is armed."""
    serving = moments is SERVE_MOMENTS
    pb = powered(workers=1 if serving else 0, segment_bytes=1 << 20)
    jobs = {}
    client = None
    for n, (moment, (op, glob, nth, when)) in enumerate(moments.items()):
        job = f"j{n}"
        lines = tmp_path / f"{job}.jsonl"
        jobs[job] = (lines, write_jsonl(lines, 300, seed=n, bad_every=40))
        if client is not None:  # the last job's submit gives up on its own while the broker
            client.join(timeout=30)  # starts again: it sends nothing after the next arm
        disk.arm(op, glob.format(job=job), nth, when)
        acked, client = submit_in_background(pb, lines, job)
        wait_for(disk.fired, f"the moment: {moment}")
        acked_before_cut = set(acked)  # nothing more is acknowledged: nothing more is durable
        pb.cut()
        assert_acked_survived(pb, job, acked_before_cut, moment)
        if serving:
            client.join(timeout=30)
            assert submit(pb.config, lines, "--job-id", job).returncode == 0
            wait_for(lambda j=job: pb.broker.job_status(j)["state"] == "completed", job, 60)
    client.join(timeout=30)
    if not serving:  # resumed only now: each moment's life made its own segments for its job
        for job, (lines, _good) in jobs.items():
            resumed = submit(pb.config, lines, "--job-id", job)
            assert resumed.returncode == 0, resumed.stderr
        assert pb.broker.stop() == 0, pb.broker.stderr  # and a worker to serve them
        pb.config.write_text(pb.config.read_text().replace("local = 0", "local = 1"))
        pb.broker = pb._start()
    for job, (_lines, good) in jobs.items():
        fetch_and_check(pb, job, good)
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


def test_torn_writes_then_a_cut_while_the_dispatch_file_is_replaced_lose_no_acknowledged_line(
    tmp_path,
):
    """A seeded disk: what was not synced at a cut survives in part, torn at 512-byte sectors
    (a disk's own write-back order). The power goes once a group commit is synced and not
    yet acknowledged; the broker starts on the torn remains, and the power goes again while
    dispatch replaces its file (gpu/dispatch/file.py `_replace`, what a compaction does too:
    the new file renamed over the old, `dispatch/` not yet synced). Every chunk acknowledged
    before the first cut is committed, each line has one outcome, `check` is clean."""
    reason = available()
    if reason:
        skip_or_fail(reason)
    disk = PowerDisk(tmp_path / "disk", tmp_path / "data", seed=SEED).mount()
    pb = PoweredBroker(tmp_path, disk, workers=1, segment_bytes=1 << 20)
    try:
        lines = tmp_path / "in.jsonl"
        good = write_jsonl(lines, 300, seed=6, bad_every=40)
        disk.arm("fsync", "segments/in-*", 3, "after")
        acked, client = submit_in_background(pb, lines, "j")
        wait_for(disk.fired, "the third group commit")
        acked_before_cut = set(acked)
        first = pb.cut_while_starting("rename", "dispatch/inflight.log")
        assert first["torn_records_kept"] > 0, first  # the seed kept torn unsynced writes
        assert pb.disk.last_fired["path"] == "/dispatch/inflight.log"
        assert_acked_survived(pb, "j", acked_before_cut)
        finish_and_check(pb, "j", lines, good)
        client.join(timeout=30)
    finally:
        pb.close()
        disk.close()


# Dispatch compacts its file when it is over `compact_min_bytes` and three quarters of it are
# resolved batches (gpu/dispatch/lease_recorder.py). One-item batches write 79 bytes each (a
# lease of one item and its end): 1 MiB would take 13,000 of them, minutes on this disk, so
# the broker here compacts from 8 KiB (about 100 batches) by its own trigger all the same.
COMPACTION = "reregister_grace_s = 0.5\ncompact_min_bytes = 8192"
DISPATCH_FILE = "dispatch/inflight.log"


def test_a_cut_while_dispatch_compacts_its_file_loses_no_acknowledged_line(tmp_path, powered):
    """A job served in one-item batches grows the dispatch file until dispatch compacts it on
    its own (over `compact_min_bytes`, mostly resolved batches); the power goes once the
    compacted file is renamed over the old one and `dispatch/` is not yet synced. The broker
    comes back, the job ends with each line once, `check` is clean."""
    pb = powered(workers=2, dispatch=COMPACTION, worker_keys="batch_items = 1\ntarget_batch_s = 0")
    lines = tmp_path / "in.jsonl"
    ids = requests_lines(lines, 400)
    assert submit(pb.config, lines, "--job-id", "j").returncode == 0
    grown = pb.disk.live / DISPATCH_FILE
    # Past half the threshold the next rename of the file is compaction's: a broker life
    # replaces the file at its start only. The file renamed over it is smaller.
    size = wait_for(lambda: grown.stat().st_size > 4096 and grown.stat().st_size, "growth", 60)
    pb.disk.arm("rename", DISPATCH_FILE, 1, "after")
    wait_for(pb.disk.fired, "dispatch to compact its file", 60)
    assert grown.stat().st_size < size, (grown.stat().st_size, size)
    pb.cut()
    wait_for(lambda: pb.broker.job_status("j")["state"] == "completed", "job j to complete", 90)
    out = tmp_path / "j.out.jsonl"
    fetched = run_cli("results", "j", "-o", str(out), "--all", "--config", str(pb.config))
    assert fetched.returncode == 0, fetched.stderr
    counts = outcomes(out)
    assert set(counts) == ids, sorted(ids - set(counts))[:5]
    assert max(counts.values()) == 1, [c for c, n in counts.items() if n > 1][:5]
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


def cut_mid_slot(segments: Path) -> None:
    """Damage the input segment holding the most items as a disk might: cut it (durably)
    in the middle of its written slots, so the items past the cut are gone."""
    best = (-1, None)
    for path in segments.glob("in-*.seg"):
        header = parse_header(path.read_bytes()[:HEADER_BYTES], path)
        entries = struct.unpack_from("<Q", path.read_bytes()[:HEADER_BYTES], ENTRIES_OFFSET)[0]
        best = max(best, (entries, path, header), key=lambda x: x[0])
    entries, path, header = best
    assert entries >= 20, best
    with open(path, "r+b") as f:
        os.ftruncate(f.fileno(), header.slots_offset + entries // 2 * header.slot_bytes + 9)
        os.fsync(f.fileno())


def test_a_cut_between_moving_a_damaged_segment_aside_and_its_error_results_loses_no_line(
    tmp_path, powered
):
    """A start finds an input segment cut mid-slot: it copies the trusted items to a new
    segment, moves the file to `damaged/` (directories synced), then gives each item lost
    with it a `corrupt_input` error result. The power goes after the move, before those
    results: the next start must still account for them (the file it would have found is
    aside). Every acknowledged line ends with one outcome, an error for the lost, and
    `check` is clean."""
    pb = powered(workers=0)
    lines = tmp_path / "in.jsonl"
    good = write_jsonl(lines, 300, seed=7)
    assert submit(pb.config, lines, "--job-id", "j").returncode == 0
    assert pb.broker.stop() == 0, pb.broker.stderr
    cut_mid_slot(pb.disk.mount_path / "segments")
    pb.config.write_text(pb.config.read_text().replace("local = 0", "local = 1"))
    # the copy's segment is made (segments/ synced), the file moved aside, segments/ synced
    pb.start_until_cut("fsyncdir", "segments", 2, "after")
    wait_for(lambda: pb.broker.job_status("j")["state"] == "completed", "job j to complete", 60)
    out = tmp_path / "j.out.jsonl"
    fetched = run_cli("results", "j", "-o", str(out), "--all", "--config", str(pb.config))
    assert fetched.returncode == 0, fetched.stderr
    counts = outcomes(out)
    assert set(counts) == {f"r{i}" for i in good}, sorted({f"r{i}" for i in good} - set(counts))
    assert max(counts.values()) == 1, [c for c, n in counts.items() if n > 1][:5]
    errors = out.with_name(out.name + ".errors.jsonl").read_text()
    assert "corrupt_input" in errors  # the lost items, said so
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


def test_a_result_file_made_by_a_run_killed_before_its_directory_sync_survives_a_cut(disk):
    """A results client killed between making OUT and syncing its directory: the next run
    opens the file that is there, writes and syncs a page and acknowledges it. A cut then
    must find the page: the name too must have been made durable by that run."""
    out = disk.mount_path / "out.jsonl"
    os.close(os.open(out, os.O_WRONLY | os.O_CREAT, 0o644))  # the killed run's file
    with ResultFile.open(out) as again:
        again.write([b'{"id":"x-line-1","custom_id":"a"}\n'], ["custom_id:a"])
        again.sync()  # acknowledged from here on
    disk.cut()
    disk.mount()
    assert out.exists() and out.read_bytes() == b'{"id":"x-line-1","custom_id":"a"}\n'


def test_a_job_log_made_by_a_stage_killed_before_its_directory_sync_survives_a_cut(disk):
    """The same for a job's record log (pipeline/store/records.py): a stage killed between
    making `chunks.log` and syncing its directory; the next open syncs a record in it."""
    log = disk.mount_path / "chunks.log"
    os.close(os.open(log, os.O_WRONLY | os.O_CREAT, 0o644))  # the killed stage's file
    records = RecordLog(log)
    records.append({"chunk": 0})
    records.sync()  # the commit is acknowledged from here on
    records.close()
    disk.cut()
    disk.mount()
    assert read_records(log)[0] == [{"chunk": 0}]


SEED = 20261207  # the torn writes' seed: the same remains on every run


def test_cuts_between_a_results_page_fsync_and_its_acknowledgement_write_each_line_once(
    tmp_path, powered
):
    """The results client's machine loses power at its first page's fsync: not yet done
    ("before": the page is lost and was never acknowledged, so it comes again) or done but
    not yet acknowledged ("after": it comes again and must not be written twice). A job for
    each, fetched to the client's own disk; the broker runs on."""
    pb = powered(workers=1)
    good = {}
    for job in ("before", "after"):
        lines = tmp_path / f"{job}.jsonl"
        good[job] = write_jsonl(lines, 300, seed=2)
        assert submit(pb.config, lines, "--job-id", job, "--chunk-lines", "50").returncode == 0
    for job in good:
        wait_for(lambda j=job: pb.broker.job_status(j)["state"] == "completed", job, 60)
    out_disk = PowerDisk(tmp_path / "client-disk", tmp_path / "client").mount()
    try:
        for when in good:  # the job of that name
            out = out_disk.mount_path / f"{when}.jsonl"
            out_disk.arm("fsync", out.name, nth=1, when=when)
            results = ["results", when, "-o", str(out), "--config", str(pb.config)]
            client = zygote.Popen(
                [sys.executable, str(REPO / "run.py"), *results],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=REPO,
            )
            wait_for(out_disk.fired, f"the first page's fsync ({when})")
            out_disk.cut(client.pid)
            client.wait(timeout=30)
            out_disk.mount()
            again = run_cli(*results)
            assert again.returncode == 0, again.stderr
            counts = outcomes(out)
            assert set(counts) == {f"r{i}" for i in good[when]}, when
            assert max(counts.values()) == 1, (when, [c for c, n in counts.items() if n > 1][:5])
    finally:
        out_disk.close()
    assert pb.broker.stop() == 0
    assert_check_clean(pb.broker.data_dir)


BATCH_MOMENTS = {
    "the third completion sync": ("fsync", "data/completion/out-*", 3),
    "the output's first page": ("fsync", "out.jsonl", 1),
}


@pytest.mark.parametrize("moment", BATCH_MOMENTS)
def test_a_cut_of_run_py_batch_and_its_private_broker_resumes_each_line_once(tmp_path, moment):
    """`run.py batch` with its output, its state dir beside it and its private broker's data
    dir on one disk: the power goes while it stores results or writes them, and a run
    again finishes the file with each line once."""
    reason = available()
    if reason:
        skip_or_fail(reason)
    disk = PowerDisk(tmp_path / "disk", tmp_path / "work").mount()
    lines = tmp_path / "in.jsonl"
    good = write_jsonl(lines, 300, seed=3)
    out = disk.mount_path / "out.jsonl"
    args = [sys.executable, str(REPO / "run.py"), "batch", str(lines), "-o", str(out)]
    config = write_config(
        tmp_path, workers=1, data_dir=disk.mount_path / "data", dispatch=SHORT_GRACE
    )
    args += ["--config", str(config)]
    log = tmp_path / "batch.err"
    try:
        op, glob, nth = BATCH_MOMENTS[moment]
        disk.arm(op, glob, nth, when="after")
        with open(log, "ab") as err:
            first = zygote.Popen(
                args, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, start_new_session=True
            )
        wait_for(disk.fired, moment, timeout_s=60)
        disk.cut(first.pid)
        first.wait(timeout=30)
        disk.mount()
        with open(log, "ab") as err:
            last = zygote.Popen(
                args, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, start_new_session=True
            )
        assert last.wait(timeout=120) == 0, log.read_text()[-3000:]
        counts = outcomes(out)
        assert set(counts) == {f"r{i}" for i in good}, log.read_text()[-3000:]
        assert max(counts.values()) == 1, [c for c, n in counts.items() if n > 1][:5]
    finally:
        disk.close()


def test_a_cut_during_a_vector_journal_append_stores_each_vector_once(tmp_path, powered):
    """Embeddings delivered to a vector store: the power goes once the second journal record
    of a shard is durable; after the restart each line is in the store or an error once."""
    from test_vector_delivery import SIM_WORKER, delivered, write_texts
    from test_vector_delivery import outcomes as vector_outcomes

    pb = powered(workers=1, worker_keys=SIM_WORKER)
    lines = tmp_path / "texts.jsonl"
    valid = write_texts(lines, 300, seed=5)
    pb.disk.arm("fsync", "vectors/*.journal", nth=2, when="after")
    args = ("--job-id", "emb", "--deliver", "vectors:docs")
    client = threading.Thread(target=lambda: submit(pb.config, lines, *args), daemon=True)
    client.start()
    wait_for(pb.disk.fired, "the second journal record")
    pb.cut()
    assert submit(pb.config, lines, *args).returncode == 0
    wait_for(lambda: delivered(pb.broker, "emb"), "the job to be delivered", timeout_s=90)
    stored, errors = vector_outcomes(pb.broker, "docs", "emb")
    assert len(stored) == len(set(stored)) == valid, (len(stored), len(set(stored)), valid)
    assert not set(stored) & set(errors)
    assert pb.broker.stop() == 0
    assert_check_clean(pb.broker.data_dir)
    client.join(timeout=30)


def requests_lines(path: Path, n: int, wrong_url_at: int | None = None) -> set[str]:
    """`n` embedding requests for `echo`; the line `wrong_url_at` (0-based) names another url
    (kept out of the job as an error when the batch accepts partial input)."""
    with open(path, "w") as out:
        for i in range(n):
            url = "/v1/completions" if i == wrong_url_at else "/v1/embeddings"
            body = {"model": "echo", "prompt_token_ids": [1 + i % 50, 2, 3]}
            out.write(
                json.dumps({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body})
            )
            out.write("\n")
    return {f"q{i}" for i in range(n)}


API_DONE = ("completed", "failed", "expired", "cancelled")


def _api_up(client) -> bool:
    import openai

    try:
        client.models.list()
    except openai.APIConnectionError:
        return False
    return True


def _content(client, file_id: str | None) -> bytes:
    return b"" if file_id is None else client.files.content(file_id).content


def api_finish(client, batch_id: str):
    def ended():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in API_DONE else None

    return wait_for(ended, f"batch {batch_id} to end", timeout_s=90, interval_s=0.3)


# Where the power goes while files are uploaded and batches made over HTTP: the first file
# is acknowledged before; its batch, then (where `second`) a second file and its batch are
# on their way. (op, path glob, nth, when, second)
ENDPOINTS = '["/v1/embeddings", "/v1/completions"]'
BATCH_DIR = "api/batches/batch_" + "?" * 24  # a batch's directory, none of its files
API_MOMENTS = {
    "an upload's bytes synced": ("fsync", "api/files/.upload-*", 1, "after", True),
    "an upload's record": ("rename", "api/files/file-*.json", 1, "after", True),
    "a batch renamed into place": ("rename", BATCH_DIR, 1, "after", True),
    # the first batch is in_progress, its job made, none of its lines committed yet: they go
    # to the job from the driver's copy of the file without the line of another url
    "a batch's job fed from its copy": ("fsync", "jobs/batch_*/chunks.log", 1, "before", False),
}


@pytest.mark.parametrize(
    "moments", [list(API_MOMENTS)[:2], list(API_MOMENTS)[2:]], ids=["uploads", "batches"]
)
def test_cuts_during_http_uploads_and_batch_creates_keep_what_was_answered(
    tmp_path, powered, moments
):
    """Every file and batch answered 200 before a cut is there whole after it, and each
    batch (made again where its create was not answered) ends with each line once. The
    first file's batch accepts partial input and has a line of another url first, so its
    lines go to its job from the driver's copy of the file without it. One broker takes the
    moments in turn, each with its own files, its batches ended before the next."""
    import openai

    port = free_port()
    extra = f'[api]\nenabled = true\nbind = "127.0.0.1:{port}"\n'
    pb = powered(workers=1, extra=extra, endpoints=ENDPOINTS)
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=10)
    for n, moment in enumerate(moments):
        api_cut(pb, client, tmp_path / str(n), moment)
    assert pb.broker.stop() == 0, pb.broker.stderr
    assert_check_clean(pb.broker.data_dir)


def api_cut(pb: PoweredBroker, client, where: Path, moment: str) -> None:
    """The first file uploaded; then, on their way, its batch, a second file and its batch
    (API_MOMENTS); the power goes at `moment`; what was answered is checked and every batch
    ended with each line once."""
    import openai

    where.mkdir()
    first, second = where / "first.jsonl", where / "second.jsonl"
    ids = {first: requests_lines(first, 300, wrong_url_at=0), second: requests_lines(second, 100)}
    files = {first: client.files.create(file=("first.jsonl", first.read_bytes()), purpose="batch")}
    batches: dict[Path, str] = {}

    def make_batch(path: Path) -> str:
        partial = {"fabric_accept_partial": "true"}
        return client.batches.create(
            input_file_id=files[path].id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata=partial if path == first else None,
        ).id

    def user() -> None:  # stops at the first request the cut leaves unanswered
        with contextlib.suppress(openai.APIError):
            batches[first] = make_batch(first)
            if not second_too:
                return
            files[second] = client.files.create(
                file=("second.jsonl", second.read_bytes()), purpose="batch"
            )
            batches[second] = make_batch(second)

    *armed, second_too = API_MOMENTS[moment]
    pb.disk.arm(*armed)
    thread = threading.Thread(target=user, daemon=True)
    thread.start()
    wait_for(pb.disk.fired, f"the moment: {moment}")
    answered = (dict(files), dict(batches))
    pb.cut()
    thread.join(timeout=30)
    wait_for(lambda: _api_up(client), "the api to answer again", timeout_s=60)
    files, batches = answered
    for path, record in files.items():
        assert client.files.content(record.id).content == path.read_bytes(), (moment, path.name)
        batch_id = batches.get(path) or make_batch(path)
        ended = api_finish(client, batch_id)
        assert ended.status == "completed", (moment, ended)
        out = [json.loads(x) for x in _content(client, ended.output_file_id).splitlines()]
        err = [json.loads(x) for x in _content(client, ended.error_file_id).splitlines()]
        counts = Counter(x["custom_id"] for x in out + err)
        assert set(counts) == ids[path], (moment, sorted(ids[path] - set(counts))[:5])
        assert max(counts.values()) == 1, (moment, [c for c, n in counts.items() if n > 1][:5])
