"""The batch driver (api/batch_driver.py) stepped in process on a fake wall clock.

The driver runs over a real broker's ingest and completion ports (one local
`echo` worker; `texty` has none, so its jobs wait until cancelled), on real
files; only its clock is the test's: `step(now)` stamps the record, decides
expiry at `expires_at` and paces the fetches. Each test reads the statuses
the driver wrote (every `put`, in order) and the stamps, which are the fake
clock's, never the wall's.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from broker import Broker, write_config
from conftest import wait_for

from api.batch_driver import FETCH_EVERY_S, BatchDriver
from api.batch_record import BatchRecord
from api.batch_store import BatchStore, new_batch_id
from api.file_store import FileStore
from collector.results_client import ResultsClient
from ingest.submit_client import Producer
from pipeline.core.job_states import BatchStatus
from pipeline.transport.topology import client_address

S = BatchStatus
T0 = 1_700_000_000  # the fake wall clock's start (unix seconds)
WINDOW_S = 3600


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("api-stepped"), workers=1)
    broker = Broker(config).start()
    try:
        yield broker
    finally:
        broker.close()


class Recording(BatchStore):
    """A BatchStore that remembers the status of every record it writes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.written: dict[str, list[BatchStatus]] = {}

    def put(self, record: BatchRecord) -> None:
        super().put(record)
        seen = self.written.setdefault(record.id, [])
        if not seen or seen[-1] != record.status:
            seen.append(record.status)


class Stepped:
    """A BatchDriver over the broker, its clock `now` (starts at T0, moves when told)."""

    def __init__(self, broker: Broker, root: Path) -> None:
        self.root = root
        self.files = FileStore(root)
        self.batches = Recording(root)
        ingest = client_address(broker.settings.ingest.bind)
        self.producers = (Producer(ingest), Producer(ingest))
        self.results = ResultsClient(client_address(broker.settings.completion.bind))
        self.driver = BatchDriver(self.files, self.batches, self.producers, self.results)
        self.now = float(T0)

    def step(self, seconds: float = 0.0) -> dict[str, int]:
        self.now += seconds
        return self.driver.step(self.now)

    def until(self, batch_id: str, status: BatchStatus, timeout_s: float = 60) -> BatchRecord:
        """Step (the clock still) until the batch has `status`; the broker's work is real."""

        def reached():
            self.step()
            record = self.batches.get(batch_id)
            return record if record.status == status else None

        return wait_for(reached, f"batch {batch_id} to be {status}", timeout_s=timeout_s)

    def batch(self, lines: list[dict], created_at: int = T0) -> str:
        """A batch of `lines` (created at `created_at`, expiring WINDOW_S later)."""
        tmp = self.files.upload_path()
        tmp.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
        file = self.files.commit_upload(tmp, "me", "in.jsonl", tmp.stat().st_size, 86400)
        batch_id = new_batch_id()  # also its job's id: one the broker has not seen
        record = BatchRecord(
            id=batch_id,
            owner="me",
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="1h",
            created_at=created_at,
            expires_at=created_at + WINDOW_S,
        )
        self.batches.create(record)
        return batch_id

    def lines(self, batch_id: str, name: str) -> list[dict]:
        path = self.batches.path(batch_id, name)
        return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []

    def close(self) -> None:
        self.driver.close()
        self.results.close()
        for producer in self.producers:
            producer.close()


@pytest.fixture
def stepped(broker, tmp_path):
    driver = Stepped(broker, tmp_path / "api")
    try:
        yield driver
    finally:
        driver.close()


def echo_lines(n: int, prefix: str = "e") -> list[dict]:
    body = lambda i: {"model": "echo", "prompt_token_ids": [1 + i % 40, 2, 3]}  # noqa: E731
    return [
        {"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/embeddings", "body": body(i)}
        for i in range(n)
    ]


def texty_lines(n: int) -> list[dict]:
    """Text lines for `texty`, which no worker serves: their job waits (and is tokenized)."""
    body = lambda i: {"model": "texty", "input": f"hello world number {i}"}  # noqa: E731
    return [
        {"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings", "body": body(i)}
        for i in range(n)
    ]


def test_a_batch_goes_validating_in_progress_finalizing_completed_stamped_by_now(stepped):
    batch_id = stepped.batch(echo_lines(50))
    stepped.step(2.0)  # validation starts at T0 + 2
    record = stepped.until(batch_id, S.IN_PROGRESS)
    assert record.in_progress_at == T0 + 2
    stepped.now += 10.0
    record = stepped.until(batch_id, S.COMPLETED)
    assert stepped.batches.written[batch_id] == [S.IN_PROGRESS, S.FINALIZING, S.COMPLETED]
    assert record.finalizing_at == record.completed_at == T0 + 12
    assert record.request_counts == {"total": 50, "completed": 50, "failed": 0}
    assert {x["custom_id"] for x in stepped.lines(batch_id, "output.jsonl")} == {
        f"e{i}" for i in range(50)
    }
    assert record.output_file_id and stepped.files.get(record.output_file_id).bytes > 0


def test_a_cancelled_batch_ends_cancelled_with_its_job(stepped):
    batch_id = stepped.batch(texty_lines(20))
    stepped.until(batch_id, S.IN_PROGRESS)
    stepped.batches.request_cancel(batch_id)
    stepped.now += 5.0
    record = stepped.until(batch_id, S.CANCELLED)
    assert stepped.batches.written[batch_id] == [
        S.IN_PROGRESS,
        S.CANCELLING,
        S.FINALIZING,
        S.CANCELLED,
    ]
    assert record.cancelled_at == T0 + 5
    assert stepped.results.job_status(batch_id)["state"] == "cancelled"
    assert {x["error"]["code"] for x in stepped.lines(batch_id, "error.jsonl")} == {"cancelled"}


def test_a_batch_expires_at_expires_at_of_the_fake_clock_and_not_before(stepped):
    batch_id = stepped.batch(texty_lines(20))
    stepped.until(batch_id, S.IN_PROGRESS)
    stepped.now = T0 + WINDOW_S - 1  # a second before: still running, whatever the wall says
    for _ in range(5):
        stepped.step()
    assert stepped.batches.get(batch_id).status == S.IN_PROGRESS
    assert not stepped.batches.get(batch_id).expiring
    stepped.now = T0 + WINDOW_S
    record = stepped.until(batch_id, S.EXPIRED)
    assert record.expired_at == T0 + WINDOW_S and record.expiring
    assert stepped.results.job_status(batch_id)["state"] == "expired"
    errors = stepped.lines(batch_id, "error.jsonl")
    assert {x["custom_id"] for x in errors} == {f"t{i}" for i in range(20)}
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}


def test_a_batch_past_its_deadline_before_it_ran_expires_without_a_job(stepped):
    batch_id = stepped.batch(echo_lines(5, prefix="late"), created_at=T0 - WINDOW_S)
    record = stepped.until(batch_id, S.EXPIRED)
    assert stepped.batches.written[batch_id] == [S.EXPIRED]
    assert record.expired_at == T0 and record.in_progress_at is None
    assert not stepped.producers[0].job_status(batch_id)["exists"]
    assert record.request_counts == {"total": 5, "completed": 0, "failed": 5}


def test_a_new_driver_resumes_a_running_batch_after_a_restart(broker, stepped):
    """The driver keeps nothing but the record: a second one (a restarted api-0) takes up a
    batch the first left in_progress, with its results fetched by now, and finishes it."""
    batch_id = stepped.batch(echo_lines(40, prefix="r"))
    stepped.until(batch_id, S.IN_PROGRESS)
    stepped.close()
    second = Stepped(broker, stepped.root)
    second.now = T0 + 30
    try:
        record = second.until(batch_id, S.COMPLETED)
        # the second driver may first record the job's submission done (still in_progress),
        # where the first closed before its submitter finished (seen under load)
        written = [s for s in second.batches.written[batch_id] if s != S.IN_PROGRESS]
        assert written == [S.FINALIZING, S.COMPLETED]
        assert record.in_progress_at == T0 and record.completed_at == T0 + 30
        out = second.lines(batch_id, "output.jsonl")
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(40))
    finally:
        second.close()
    stepped.driver = BatchDriver(stepped.files, stepped.batches, stepped.producers, stepped.results)


def test_results_of_a_running_batch_are_fetched_and_counted_before_it_ends(stepped):
    """While the job is still open (its `texty` lines wait), the results it has are fetched
    into the output file and counted; the batch stays in_progress."""
    lines = texty_lines(3) + echo_lines(30, prefix="f")
    batch_id = stepped.batch(lines)
    stepped.until(batch_id, S.IN_PROGRESS)
    done = lambda: stepped.results.job_status(batch_id)["completed"] >= 30  # noqa: E731
    wait_for(done, "echo's items to have results")
    stepped.step(FETCH_EVERY_S)
    assert len(stepped.lines(batch_id, "output.jsonl")) == 30
    record = stepped.batches.get(batch_id)
    assert record.status == S.IN_PROGRESS
    assert record.request_counts == {"total": 33, "completed": 30, "failed": 0}


def test_a_record_written_by_the_old_driver_loads_and_is_written_back_the_same(tmp_path):
    """batch.json as the dict-based driver wrote it (its keys, no others) loads, drives and
    dumps to the same JSON, keys the record does not know included."""
    old = {
        "id": "batch_old1",
        "owner": "me",
        "input_file_id": "file-x",
        "endpoint": "/v1/embeddings",
        "completion_window": "24h",
        "metadata": {"fabric_accept_partial": "true"},
        "created_at": T0,
        "expires_at": T0 + 86400,
        "status": "validating",
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "errors": None,
        "ending": {"status": "failed", "errors": [{"code": "x", "line": 2, "message": "m"}]},
        "submit_path": "/x/in.jsonl",
        "submitted": False,
        "job_cancelled": True,
        "a_later_key": [1, 2],
    }
    record = BatchRecord.from_json(orjson.dumps(old))
    assert record.status == S.VALIDATING and record.ending.status == S.FAILED
    assert record.ending.errors[0]["line"] == 2 and record.job_cancelled
    assert not record.submitted and record.accepts_partial("fabric_accept_partial")
    again = orjson.loads(record.to_json())
    assert {k: again[k] for k in old} == old
    assert BatchRecord.from_json(record.to_json()) == record
    in_progress = {k: v for k, v in old.items() if k not in ("ending", "submitted")}
    in_progress.update(status="in_progress", in_progress_at=T0 + 1, ended_as="expired")
    loaded = BatchRecord.from_json(orjson.dumps(in_progress))
    assert loaded.submitted and loaded.ended_as == "expired" and loaded.local_errors == 0
    assert loaded.stamp(S.IN_PROGRESS) == T0 + 1
