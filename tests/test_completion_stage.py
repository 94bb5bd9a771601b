"""A real CompletionStage driven in-process, one `step(now)` at a time, on a fake clock.

Its sockets are real (ipc and loopback), its files are real; only the clocks
are the test's: `now` for every deadline and a fake wall clock for the
`finished` mark. These tests hold that a job finishes where it finishes (its
last result stored, or found finished at start) and that reads never write.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from broker import write_config
from conftest import appender, make_batch

from collector.completion.completion_stage import CompletionStage
from collector.segments import SegmentCollector
from config import load_settings
from config.stage_settings import stage_settings
from gpu.work_protocol import ITEM_DTYPE
from ingest.jobs import JobRegistry
from pipeline.core.item_seq import seq_of
from pipeline.store.datadir import DataDir
from pipeline.transport import wire
from pipeline.transport.topology import internal_address

MT = wire.MessageType
WALL_NS = 1_000 * 10**9  # the fake wall clock at which jobs finish in these tests


@pytest.fixture
def settings(tmp_path):
    return load_settings(write_config(tmp_path))


class Harness:
    """A CompletionStage on a fake clock, with a results client and dispatch's PUSH socket."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.stage = CompletionStage(stage_settings(settings, "completion"), 0)
        self.stage.open()
        self.stage.wall_ns = lambda: self.wall_ns
        self.wall_ns = WALL_NS
        self.now = 0.0
        self.context = zmq.Context()
        self.client = self.context.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(settings.completion.bind)
        self.dispatch = self.context.socket(zmq.PUSH)
        self.dispatch.setsockopt(zmq.LINGER, 0)
        self.dispatch.connect(internal_address(settings, "completion"))
        self.from_stage = self.context.socket(zmq.PULL)  # dispatch's side: RETIRED, CANCEL_JOB
        self.from_stage.setsockopt(zmq.LINGER, 0)
        self.from_stage.bind(internal_address(settings, "dispatch"))

    def step(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.stage.step(self.now)

    def ask(self, kind: MT, meta: dict) -> wire.Message:
        """Send a client request and step the stage until it answers (at this `now`)."""
        wire.send(self.client, kind, meta)
        for _ in range(200):  # each step polls up to 10 ms: the request arrives within these
            self.stage.step(self.now)
            answer = wire.recv(self.client, 0)
            if answer is not None:
                return answer
        raise AssertionError(f"no answer to {kind.name} {meta}")

    def item_errors(self, items: np.ndarray, reason: str) -> None:
        """Dispatch's ITEM_ERRORS; step until the stage has stored them."""
        before = self.stage.intake.stored
        wire.send(self.dispatch, MT.ITEM_ERRORS, {"reason": reason}, {"items": items})
        for _ in range(200):
            self.stage.step(self.now)
            if self.stage.intake.stored > before:
                return
        raise AssertionError("the item errors were never stored")

    def close(self) -> None:
        self.client.close(0)
        self.dispatch.close(0)
        self.from_stage.close(0)
        self.context.term()
        self.stage.close()


@pytest.fixture
def harness(settings):
    h = Harness(settings)
    yield h
    h.close()


def submit(settings, job_id: str, stored: int, rejected: int):
    """A job as the front leaves it: one final chunk of `stored` lines (written to an input
    segment, seqs of this job) and `rejected` lines (in the journal only)."""
    registry = JobRegistry(settings.data_path)
    job = registry.create(job_id, chunk_lines=stored + rejected)
    job.accept(0, 1, stored + rejected)
    errors = [[stored + k + 1, f"r{k}", "bad_json", "not JSON"] for k in range(rejected)]
    ids = [f"s{k}" for k in range(stored)]
    job.commit(0, list(range(1, stored + 1)), ids, stored, errors, final=True)
    registry.touch(job)
    registry.flush()
    registry.close()
    items = np.zeros(stored, ITEM_DTYPE)
    if stored:
        data_dir = DataDir(settings.data_path).ensure()
        log = appender(data_dir)
        _, _, _, counts, tokens = make_batch(np.random.default_rng(0), stored, 1)
        index = np.arange(stored, dtype=np.uint32)
        seq = seq_of(job.job_no, index)
        log.append(seq, np.full(stored, job.job_no, np.uint64), index, counts, tokens)
        log.close()
        (path,) = data_dir.segment_files()
        items["segment"] = int(path.name[3:15])
        items["slot"] = np.arange(stored)
        items["seq"] = seq
    return job.job_no, items


def finished_ns(settings, job_id: str) -> int | None:
    path = settings.data_path / "jobs" / job_id / "finished"
    return int(path.read_text()) if path.exists() else None


def files_of(settings) -> dict[str, tuple[int, int]]:
    """Every file under jobs/ and completion/: (size, mtime ns)."""
    out = {}
    for top in ("jobs", "completion"):
        for path in sorted((settings.data_path / top).rglob("*")):
            if path.is_file():
                stat = path.stat()
                out[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_a_job_finishes_when_its_last_result_is_stored_not_when_someone_asks(settings, harness):
    _, items = submit(settings, "job-a", stored=3, rejected=0)
    harness.step()  # the first step takes up the job
    harness.item_errors(items[:2], "dead_letter: failed 3 times")
    assert finished_ns(settings, "job-a") is None  # one item still to go
    harness.wall_ns += 5 * 10**9
    harness.item_errors(items[2:], "dead_letter: failed 3 times")
    harness.step()  # no tidy is due (the clock has not moved): finished by its last result
    assert finished_ns(settings, "job-a") == WALL_NS + 5 * 10**9
    harness.wall_ns += 100 * 10**9
    info = harness.ask(MT.JOB_STATUS, {"job": "job-a"}).meta
    assert (info["state"], info["failed"]) == ("completed", 3)
    assert finished_ns(settings, "job-a") == WALL_NS + 5 * 10**9  # retention clock unmoved


def test_a_job_whose_lines_were_all_rejected_finishes_without_anyone_asking(settings, harness):
    submit(settings, "job-r", stored=0, rejected=4)
    harness.step()
    harness.step(0.01)  # its error results became durable in the first: it ends at once
    assert finished_ns(settings, "job-r") == WALL_NS


def test_a_job_done_before_a_restart_is_finished_at_the_first_step(settings):
    _, items = submit(settings, "job-d", stored=2, rejected=1)
    first = Harness(settings)
    try:
        first.stage.finishing.finish = lambda view: None  # killed before it wrote the mark
        first.step()
        first.item_errors(items, "dead_letter: failed 3 times")
    finally:
        first.close()
    assert finished_ns(settings, "job-d") is None
    second = Harness(settings)
    try:
        second.wall_ns = WALL_NS + 7 * 10**9
        second.step()  # nobody asks: the stage finds the job done
        assert finished_ns(settings, "job-d") == WALL_NS + 7 * 10**9
    finally:
        second.close()


def test_status_and_results_requests_write_nothing(settings, harness):
    submit(settings, "job-q", stored=2, rejected=1)
    harness.step()  # takes up the job and stores its rejected line's error
    harness.step(1.0)
    before = files_of(settings)
    info = harness.ask(MT.JOB_STATUS, {"job": "job-q"}).meta
    assert (info["state"], info["failed"], info["pending"]) == ("in_progress", 1, 2)
    page = harness.ask(MT.FETCH, {"job": "job-q", "all": True, "limit": 10})
    assert page.type == MT.RESULT_PAGE and len(page.arrays["index"]) == 1
    assert files_of(settings) == before
    assert finished_ns(settings, "job-q") is None


def test_a_finished_job_expires_only_once_delivered_and_past_retention(settings, harness):
    submit(settings, "job-e", stored=0, rejected=2)
    harness.step()
    harness.step(0.01)
    data_dir = DataDir(settings.data_path)
    collector = SegmentCollector()
    assert collector.sweep(data_dir, retention_s=0).removed == []  # undelivered: kept
    page = harness.ask(MT.FETCH, {"job": "job-e", "limit": 10})
    assert len(page.arrays["index"]) == 2 and page.meta["state"] == "completed"
    last = harness.ask(MT.FETCH, {"job": "job-e", "ack": page.meta["page"], "limit": 10})
    assert len(last.arrays["index"]) == 0 and last.meta["undelivered"] == 0
    harness.step(1.0)  # the tidy unloads the job: nothing of it is undelivered
    assert harness.stage.completion_log.known_jobs() == []
    assert collector.sweep(data_dir, retention_s=3600).removed == []  # sealed a moment ago
    assert len(collector.sweep(data_dir, retention_s=0).removed) == 1
    info = harness.ask(MT.JOB_STATUS, {"job": "job-e"}).meta
    assert (info["state"], info["failed"], info["undelivered"]) == ("expired", 0, 0)
    assert finished_ns(settings, "job-e") == WALL_NS  # the retention clock never moved


def test_a_cancelled_job_finishes_when_its_last_item_is_retired(settings, harness):
    job_no, items = submit(settings, "job-c", stored=2, rejected=0)
    harness.step()
    answer = harness.ask(MT.CANCEL, {"job": "job-c"})
    assert (answer.type, answer.meta["state"]) == (MT.CANCELLED, "cancelling")
    told = wire.recv(harness.from_stage, 1000)
    assert (told.type, told.meta["job_no"]) == (MT.CANCEL_JOB, job_no)
    assert finished_ns(settings, "job-c") is None
    harness.wall_ns += 3 * 10**9
    harness.item_errors(items, "cancelled: the job was cancelled")  # dispatch retires them
    assert finished_ns(settings, "job-c") == WALL_NS + 3 * 10**9
    info = harness.ask(MT.JOB_STATUS, {"job": "job-c"}).meta
    assert (info["state"], info["failed"], info["pending"]) == ("cancelled", 2, 0)
    again = harness.ask(MT.CANCEL, {"job": "job-c"})  # cancelled already: asked again
    assert again.type == MT.CANCELLED and finished_ns(settings, "job-c") == WALL_NS + 3 * 10**9


def test_a_job_cancelled_at_its_deadline_reads_in_progress_then_expired(settings, harness):
    """The HTTP API's driver cancels a batch's job at expires_at with reason `expired`: the job
    stays queued / in_progress (its batch is in_progress) until its items are retired, then
    reads `expired` (its batch's end state), never `cancelling` or `cancelled`; a reason
    the stage does not know is refused and writes no mark."""
    job_no, items = submit(settings, "job-x", stored=2, rejected=0)
    harness.step()
    refused = harness.ask(MT.CANCEL, {"job": "job-x", "reason": "bored"})
    assert refused.type == MT.ERROR and "'bored'" in refused.meta["reason"]
    answer = harness.ask(MT.CANCEL, {"job": "job-x", "reason": "expired"})
    assert (answer.type, answer.meta["state"]) == (MT.CANCELLED, "queued")
    told = wire.recv(harness.from_stage, 1000)
    assert (told.type, told.meta["job_no"]) == (MT.CANCEL_JOB, job_no)
    harness.item_errors(items, "cancelled: the job was cancelled")  # dispatch retires them
    info = harness.ask(MT.JOB_STATUS, {"job": "job-x"}).meta
    assert (info["state"], info["failed"], info["pending"]) == ("expired", 2, 0)
    again = harness.ask(MT.CANCEL, {"job": "job-x"})
    assert again.type == MT.ERROR and "already expired" in again.meta["reason"]


def test_results_of_a_chunk_not_yet_committed_wait_for_its_commit_and_go_with_their_ids(
    settings, harness
):
    """After a crash the front may have placed a chunk's items (durable in the log, so they
    can be dispatched and computed) before its commit record names their custom_ids; a
    resubmit commits them later. Their results must wait for that commit: served before it,
    they would go out (and be marked delivered) with custom_id null, and the ids never."""
    registry = JobRegistry(settings.data_path)
    job = registry.create("job-c", chunk_lines=2)
    job.accept(0, 1, 2)
    job.commit(0, [1, 2], ["c1", "c2"], 2, [], final=False)
    job.accept(1, 3, 4)  # placed, not committed: the front died here
    registry.touch(job)
    registry.flush()
    data_dir = DataDir(settings.data_path).ensure()
    log = appender(data_dir)
    _, _, _, counts, tokens = make_batch(np.random.default_rng(0), 4, 1)
    index = np.arange(4, dtype=np.uint32)
    seq = seq_of(job.job_no, index)
    log.append(seq, np.full(4, job.job_no, np.uint64), index, counts, tokens)
    log.close()
    (path,) = data_dir.segment_files()
    items = np.zeros(4, ITEM_DTYPE)
    items["segment"], items["slot"], items["seq"] = int(path.name[3:15]), np.arange(4), seq
    harness.step()
    harness.item_errors(items, "dead_letter: failed 3 times")  # every item has a result
    page = harness.ask(MT.FETCH, {"job": "job-c", "limit": 10})
    assert page.arrays["index"].tolist() == [0, 1]  # the committed chunk's only
    assert page.meta["custom_ids"] == ["c1", "c2"]
    job.commit(1, [3, 4], ["c3", "c4"], 2, [], final=True)  # the resubmitted chunk commits
    registry.touch(job)
    registry.flush()
    registry.close()
    page = harness.ask(MT.FETCH, {"job": "job-c", "limit": 10, "ack": page.meta["page"]})
    assert page.arrays["index"].tolist() == [2, 3]
    assert page.meta["custom_ids"] == ["c3", "c4"]


def test_a_page_of_long_custom_ids_is_cut_to_fit_a_message_and_every_line_still_comes(
    settings, harness
):
    """custom_ids travel in a page's metadata (at most 1 MiB); 4,096 of 512 characters do not
    fit. The page is cut to fit instead of going unanswered (the client would ask forever)."""
    n = 4096
    registry = JobRegistry(settings.data_path)
    job = registry.create("job-l", chunk_lines=n)
    job.accept(0, 1, n)
    ids = [f"{k:06d}" + "é" * 506 for k in range(n)]  # 512 characters, 1,018 bytes of UTF-8
    job.commit(0, list(range(1, n + 1)), ids, n, [], final=True)
    registry.touch(job)
    registry.flush()
    registry.close()
    data_dir = DataDir(settings.data_path).ensure()
    log = appender(data_dir, segment_bytes=4 << 20)
    _, _, _, counts, tokens = make_batch(np.random.default_rng(0), n, 1)
    index = np.arange(n, dtype=np.uint32)
    seq = seq_of(job.job_no, index)
    placed = log.append(seq, np.full(n, job.job_no, np.uint64), index, counts, tokens)
    log.close()
    items = np.zeros(n, ITEM_DTYPE)
    items["segment"] = np.repeat(placed["segment"], placed["count"])
    items["slot"] = np.concatenate([np.arange(p["first"], p["first"] + p["count"]) for p in placed])
    items["seq"] = seq
    harness.step()
    harness.item_errors(items, "dead_letter: failed 3 times")
    got: list[str] = []
    ack = 0
    for _ in range(20):
        page = harness.ask(MT.FETCH, {"job": "job-l", "limit": n, "ack": ack})
        assert page.type == MT.RESULT_PAGE
        if not len(page.arrays["index"]):
            break
        assert len(page.arrays["index"]) < n  # cut to fit
        got += page.meta["custom_ids"]
        ack = page.meta["page"]
    assert got == ids  # every line once, in order
