"""kill -9 of the api stage, or of the whole broker, at every phase of a batch: nothing
acknowledged is lost, the batch resumes and ends `completed` with each custom_id exactly
once across its output and error files, an interrupted upload leaves nothing behind, and
an Idempotency-Key retried across a kill names the one batch. Real processes, SIGKILL;
each test ends with the project's consistency check and a liveness bound."""

from __future__ import annotations

import os
import signal
import socket
from collections import Counter
from pathlib import Path

import openai
import orjson
import pytest
from broker import Broker, free_port, write_config, write_jsonl
from conftest import assert_check_clean, wait_for

from ingest.submit_client import Producer
from pipeline.transport.topology import client_address

LIVENESS_S = 120  # a batch ends this soon after the last kill
MAX_KILLS = 6  # each after the batches moved on, so in successive phases (was 10: a minute)
SLOW = 'engine = "simulated"\noptions = {tokens_per_s = 4000.0}'


def start(tmp_path: Path, worker_keys: str = SLOW) -> tuple[Broker, openai.OpenAI, int]:
    port = free_port()
    # max_restarts (in [supervisor], which `extra` continues): the kills are not a crash loop
    extra = f'max_restarts = 1000\n[api]\nenabled = true\nbind = "127.0.0.1:{port}"\n'
    config = write_config(tmp_path, extra=extra, workers=1, worker_keys=worker_keys)
    broker = Broker(config, stderr_path=tmp_path / "broker.err").start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    return broker, client, port


def restart(broker: Broker) -> None:
    broker.kill()
    broker.start()


def retrieve(client: openai.OpenAI, batch_id: str):
    """The batch, or None while the api stage is down."""
    try:
        return client.batches.retrieve(batch_id)
    except openai.APIConnectionError:
        return None


def progress(batch) -> tuple | None:
    """Where a batch stands: its status and counts (None while the api stage is down)."""
    if batch is None:
        return None
    counts = batch.request_counts
    return batch.status, counts.completed if counts else 0, counts.failed if counts else 0


def finish(client: openai.OpenAI, batch_id: str):
    def done():
        batch = retrieve(client, batch_id)
        return (
            batch
            if batch is not None and batch.status not in ("validating", "in_progress", "finalizing")
            else None
        )

    return wait_for(done, f"batch {batch_id} to end", timeout_s=LIVENESS_S, interval_s=0.3)


def assert_exactly_once(client: openai.OpenAI, batch, n: int) -> None:
    assert batch.status == "completed", batch
    lines = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            lines += client.files.content(file_id).content.splitlines()
    counts = Counter(orjson.loads(x)["custom_id"] for x in lines)
    assert set(counts) == {f"r{i}" for i in range(n)}
    assert max(counts.values()) == 1
    assert batch.request_counts.completed + batch.request_counts.failed == n
    assert batch.request_counts.total == n


@pytest.mark.slow
@pytest.mark.timeout(300)  # six broker starts; each phase has its own liveness bound
def test_whole_broker_killed_at_each_phase_resumes_and_completes_once(tmp_path):
    """Killed after the upload, between create and validation, twice in progress, and
    (left_finalizing_by_a_kill) between the `finalizing` record and the end."""
    broker, client, _ = start(tmp_path)
    try:
        n = 400
        path = tmp_path / "in.jsonl"
        write_jsonl(path, n, seed=7)
        file = client.files.create(file=(path.name, path.read_bytes()), purpose="batch")
        restart(broker)  # after the upload was acknowledged
        assert client.files.retrieve(file.id).bytes == path.stat().st_size
        made = client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            extra_headers={"Idempotency-Key": "once"},
        )
        restart(broker)  # between create and validation (or during it)
        again = client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            extra_headers={"Idempotency-Key": "once"},
        )
        assert again.id == made.id  # the retried create names the same batch

        def running():
            batch = retrieve(client, made.id)
            return batch is not None and batch.request_counts.completed >= 50

        wait_for(running, "the batch to be part done", timeout_s=LIVENESS_S, interval_s=0.2)
        restart(broker)  # in progress
        wait_for(running, "the batch to run again", timeout_s=LIVENESS_S, interval_s=0.2)
        restart(broker)
        batch = finish(client, made.id)
        assert_exactly_once(client, batch, n)
        assert batch.status == "completed"
        assert [b.id for b in client.batches.list().data] == [made.id]
        left_finalizing_by_a_kill(broker, client, batch, n)
        broker.stop()
        assert_check_clean(broker.data_dir)
    finally:
        broker.close()


@pytest.mark.slow
def test_whole_broker_killed_while_validation_sends_lines_resumes_and_completes_once(tmp_path):
    """Killed while the batch is still validating and its first chunks are already in its job
    (api/batch_validation.py sends lines as they check out): the pass runs again, resumes the
    job after the chunks it holds, and the batch completes with each custom_id once."""
    broker, client, _ = start(tmp_path, worker_keys="")  # the echo engine
    producer = None
    try:
        n = 20_000  # 100 chunks: validation takes a while
        path = tmp_path / "in.jsonl"
        write_jsonl(path, n, seed=9)
        file = client.files.create(file=(path.name, path.read_bytes()), purpose="batch")
        made = client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        producer = Producer(client_address(broker.settings.ingest.bind))

        def sending():
            committed = producer.job_status(made.id).get("committed", [])
            batch = retrieve(client, made.id)
            return committed and batch is not None and batch.status == "validating"

        wait_for(sending, "validation to be sending lines", timeout_s=LIVENESS_S)
        restart(broker)
        assert_exactly_once(client, finish(client, made.id), n)
        broker.stop()
        assert_check_clean(broker.data_dir)
    finally:
        if producer is not None:
            producer.close()
        broker.close()


def left_finalizing_by_a_kill(broker: Broker, client: openai.OpenAI, done, n: int) -> None:
    """A kill between the `finalizing` record and the end leaves the record at `finalizing`
    (made here exactly so, on the killed broker, from the batch `done`): the restarted driver
    finishes it, with the same output file, each custom_id once."""
    output = client.files.content(done.output_file_id).content
    broker.kill()
    record_path = broker.data_dir.root / "api" / "batches" / done.id / "batch.json"
    record = orjson.loads(record_path.read_bytes())
    record["status"] = "finalizing"
    del record["completed_at"]
    record_path.write_bytes(orjson.dumps(record))
    (broker.data_dir.root / "api" / "files" / f"{done.output_file_id}.json").unlink()
    broker.start()
    assert retrieve(client, done.id).status in ("finalizing", "completed")
    again = finish(client, done.id)
    assert_exactly_once(client, again, n)
    assert again.output_file_id == done.output_file_id
    assert client.files.content(again.output_file_id).content == output


@pytest.mark.slow
def test_api_stage_killed_over_and_over_while_batches_run(tmp_path):
    """SIGKILL of api-0 every half second or so: validating, submitting, fetching, finalizing."""
    broker, client, _ = start(tmp_path)
    try:
        n = 300
        path = tmp_path / "in.jsonl"
        write_jsonl(path, n, seed=8)
        file = client.files.create(file=(path.name, path.read_bytes()), purpose="batch")
        ids = [
            client.batches.create(
                input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
            ).id
            for _ in range(2)
        ]
        kills = 0
        while kills < MAX_KILLS:
            batches = [retrieve(client, i) for i in ids]
            if all(b is not None and b.status == "completed" for b in batches):
                break
            seen = [progress(b) for b in batches]
            pid = broker.pids()["api-0"]
            os.kill(pid, signal.SIGKILL)
            kills += 1
            # while it is down the report names no pid for it: .get, not [ ]
            back = lambda p=pid: broker.pids().get("api-0", p) != p and broker.all_up()  # noqa: E731
            wait_for(back, "api-0 to be restarted", timeout_s=60)
            # the next kill waits for the batches to move on (status or counts), so the kills
            # land in different phases: validating, submitting, fetching, finalizing
            moved = lambda seen=seen: any(  # noqa: E731
                progress(retrieve(client, i)) not in (None, old)
                for i, old in zip(ids, seen, strict=True)
            )
            wait_for(moved, "the batches to move on after a restart", timeout_s=LIVENESS_S)
        assert kills >= 3
        for batch_id in ids:
            assert_exactly_once(client, finish(client, batch_id), n)
        broker.stop()
        assert_check_clean(broker.data_dir)
    finally:
        broker.close()


@pytest.mark.slow
def test_an_upload_cut_by_its_client_or_a_killed_stage_leaves_nothing(tmp_path):
    broker, client, port = start(tmp_path)
    try:
        head = (
            b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        )
        body = head + b'{"custom_id": "a"}\n' * 1000
        files = broker.data_dir.root / "api" / "files"

        def arriving() -> bool:
            return any(p.name.startswith(".upload-") for p in files.iterdir())

        with socket.create_connection(("127.0.0.1", port)) as conn:  # the client goes away
            conn.sendall(
                b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                b"Content-Type: multipart/form-data; boundary=B\r\n"
                + f"Content-Length: {len(body) + 10_000_000}\r\n\r\n".encode()
                + body
            )
            wait_for(arriving, "the upload to reach the disk")
        wait_for(lambda: not arriving(), "the cut upload to be removed")
        assert [p.name for p in files.iterdir()] == []
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(
                b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                b"Content-Type: multipart/form-data; boundary=B\r\n"
                + f"Content-Length: {len(body) + 10_000_000}\r\n\r\n".encode()
                + body
            )
            wait_for(arriving, "the upload to reach the disk")
            broker.kill_stage("api-0")  # mid-upload
        assert [p.name for p in files.iterdir()] == []  # swept at start; no id was made
        assert client.files.list().data == []
        path = tmp_path / "in.jsonl"
        write_jsonl(path, 20)
        made = client.files.create(file=(path.name, path.read_bytes()), purpose="batch")
        assert client.files.content(made.id).content == path.read_bytes()
        broker.stop()
        assert_check_clean(broker.data_dir)
    finally:
        broker.close()
