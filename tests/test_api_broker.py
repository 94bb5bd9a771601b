"""The OpenAI Batch API against a real broker, driven by the official openai client unchanged:
files.create -> batches.create -> batches.retrieve until done -> files.content; every output
body validates with openai's own types; each custom_id ends exactly once across the output
and error files. Cancel, expiry and partial downloads run on a broker with a slow worker."""

from __future__ import annotations

import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

import openai
import orjson
import pytest
from broker import WORDS, Broker, free_port, write_config, write_jsonl
from client_commands import run_cli
from conftest import wait_for
from fastapi.testclient import TestClient
from openai.types import Batch, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from test_status_watch import interrupt, on_pipe, watch_command
from tokenizers import Tokenizer

from api import batch_driver, batch_validation
from api.app import make_app
from api.batch_store import BatchStore
from api.file_store import FileStore
from collector.results_client import ResultsClient
from ingest import submit_client
from ingest.batch_input import iter_batch_input
from ingest.submit_client import Producer
from pipeline.transport.topology import client_address

GENERATE = '["/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/responses"]'
DONE = ("completed", "failed", "expired", "cancelled")
FINISHED = ("cancelled", "completed")  # a job's end states (a cancel can come after its last item)
BODY_TYPES = {
    "/v1/embeddings": CreateEmbeddingResponse,
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
}


def api_broker(
    tmp_path: Path,
    worker_keys: str = "",
    processes: int = 1,
    retention_s: float | None = None,
    text_worker: bool = False,
    api_extra: str = "",
) -> tuple[Broker, str]:
    """`retention_s`: the job results' retention (the collector then sweeps every 0.3 s);
    `text_worker`: a local worker for `texty` too (text in, its tokenizer's words out);
    `api_extra`: more lines for [api] (its [[api.webhooks]] tables after them)."""
    port = free_port()
    extra = f'[api]\nenabled = true\nbind = "127.0.0.1:{port}"\nprocesses = {processes}\n'
    extra += api_extra
    if retention_s is not None:
        extra += "[collector]\ninterval_s = 0.3\n"
    workers = 0 if text_worker else 1
    config = write_config(tmp_path, extra=extra, workers=workers, worker_keys=worker_keys)
    # echo (token ids in, token ids out) and texty (text, its tokenizer) also generate
    text = config.read_text().replace(
        'endpoints = ["/v1/embeddings"]', f"endpoints = {GENERATE}", 2
    )
    if text_worker:
        text = text.replace("[workers]\nlocal = 0\n", "")
        text += '[[workers]]\nmodel = "echo"\n[[workers]]\nmodel = "texty"\n'
    if retention_s is not None:
        text = text.replace(
            "[completion]\n", f"[completion]\nresults_retention_s = {retention_s}\n"
        )
    config.write_text(text)
    broker = Broker(config, stderr_path=tmp_path / "broker.err").start()
    return broker, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """Two api processes on one port: requests land on either; api-0 drives the batches.
    Local workers for `echo` and for `texty`."""
    broker, url = api_broker(tmp_path_factory.mktemp("api-fast"), processes=2, text_worker=True)
    try:
        yield broker, openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    finally:
        broker.close()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A worker at 3,000 tokens/s: a few hundred lines take tens of seconds."""
    keys = 'engine = "simulated"\noptions = {tokens_per_s = 3000.0}'
    broker, url = api_broker(tmp_path_factory.mktemp("api-slow"), worker_keys=keys)
    try:
        yield broker, openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    finally:
        broker.close()


def finish(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> Batch:
    def done():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in DONE else None

    return wait_for(done, f"batch {batch_id} to end", timeout_s=timeout_s, interval_s=0.3)


def upload(client: openai.OpenAI, path: Path):
    return client.files.create(file=(path.name, path.read_bytes()), purpose="batch")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


def assert_each_once(out: list[dict], err: list[dict], custom_ids: set[str]) -> None:
    counts = Counter(x["custom_id"] for x in out + err)
    assert set(counts) == custom_ids
    assert max(counts.values()) == 1


def requests_file(path: Path, n: int, url: str) -> set[str]:
    with open(path, "wb") as out:
        for i in range(n):
            body = {"model": "echo", "prompt_token_ids": [1 + i % 50, 2, 3]}
            if url != "/v1/embeddings":
                body["max_tokens"] = 4
            line = {"custom_id": f"q{i}", "method": "POST", "url": url, "body": body}
            out.write(orjson.dumps(line) + b"\n")
    return {f"q{i}" for i in range(n)}


def test_the_openai_client_runs_a_batch_end_to_end(fast, tmp_path):
    _, client = fast
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 600)
    custom_ids = {f"r{i}" for i in range(600)}
    file = upload(client, path)
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"project": "test"},
    )
    assert batch.status == "validating"
    own = {k: v for k, v in (batch.metadata or {}).items() if not k.startswith("fabric_")}
    assert own == {"project": "test"}  # and the deadline's answer (docs/http-api.md, Deadlines)
    batch = finish(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    out, err = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert_each_once(out, err, custom_ids)
    assert batch.request_counts.model_dump() == {
        "total": 600,
        "completed": len(out),
        "failed": len(err),
    }
    assert err == [] and batch.error_file_id is None
    for line in out:
        assert line["response"]["status_code"] == 200
        CreateEmbeddingResponse.model_validate(line["response"]["body"])
    first = client.files.content(batch.output_file_id).content
    assert client.files.content(batch.output_file_id).content == first  # byte-identical
    outputs = client.files.list(purpose="batch_output")
    assert batch.output_file_id in {f.id for f in outputs}
    assert client.files.retrieve(batch.output_file_id).bytes == len(first)
    assert batch.id in {b.id for b in client.batches.list()}


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_generated_bodies_validate_with_openai_types(fast, tmp_path, url):
    _, client = fast
    path = tmp_path / "gen.jsonl"
    custom_ids = requests_file(path, 40, url)
    file = upload(client, path)
    batch = finish(
        client,
        client.batches.create(input_file_id=file.id, endpoint=url, completion_window="24h").id,
    )
    assert batch.status == "completed"
    out = lines_of(client, batch.output_file_id)
    assert_each_once(out, [], custom_ids)
    for line in out:
        BODY_TYPES[url].model_validate(line["response"]["body"])


def text_requests_file(path: Path, n: int, url: str) -> set[str]:
    """n text lines for `texty` (a word-level tokenizer over WORDS) in `url`'s body form."""
    bodies = {
        "/v1/chat/completions": lambda words: {"messages": [{"role": "user", "content": words}]},
        "/v1/completions": lambda words: {"prompt": words},
        "/v1/responses": lambda words: {"input": words},
    }
    with open(path, "wb") as out:
        for i in range(n):
            words = " ".join(WORDS[(7 * i + k) % len(WORDS)] for k in range(3 + i % 4))
            body = {"model": "texty", **bodies[url](words)}
            body["max_output_tokens" if url == "/v1/responses" else "max_tokens"] = 16
            line = {"custom_id": f"t{i}", "method": "POST", "url": url, "body": body}
            out.write(orjson.dumps(line) + b"\n")
    return {f"t{i}" for i in range(n)}


def generated(url: str, body: dict) -> tuple[str, list[int]]:
    """(the text, the token ids) of one generated body, read with openai's own types."""
    if url == "/v1/chat/completions":
        choice = ChatCompletion.model_validate(body).choices[0]
        return choice.message.content, body["choices"][0]["token_ids"]
    if url == "/v1/completions":
        choice = Completion.model_validate(body).choices[0]
        return choice.text, body["choices"][0]["token_ids"]
    return Response.model_validate(body).output_text, body["token_ids"]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_generated_text_is_the_models_decoding_as_run_py_results_writes_it(fast, tmp_path, url):
    """Every door renders text with the model's tokenizer (collector/delivery/decoders.py):
    over HTTP each content / text / output_text is the decoding of its line's token ids, not
    "", and the lines are those `run.py results` writes for the same job."""
    broker, client = fast
    path = tmp_path / "text.jsonl"
    custom_ids = text_requests_file(path, 20, url)
    file = upload(client, path)
    made = client.batches.create(input_file_id=file.id, endpoint=url, completion_window="24h")
    batch = finish(client, made.id)
    assert batch.status == "completed", batch
    out = lines_of(client, batch.output_file_id)
    assert_each_once(out, [], custom_ids)
    tokenizer = Tokenizer.from_file(str(broker.config.parent / "tokenizer.json"))
    for line in out:
        text, token_ids = generated(url, line["response"]["body"])
        assert token_ids and text and text == tokenizer.decode(token_ids)
    cli_out = tmp_path / "cli.jsonl"
    done = run_cli("results", batch.id, "-o", str(cli_out), "--all", "--config", str(broker.config))
    assert done.returncode == 0, done.stderr
    cli = {x["custom_id"]: x for x in map(orjson.loads, cli_out.read_bytes().splitlines())}
    assert cli == {x["custom_id"]: x for x in out}


def test_the_batch_carries_its_jobs_token_totals_as_openai_usage(fast, tmp_path):
    broker, client = fast
    path = tmp_path / "gen.jsonl"
    requests_file(path, 30, "/v1/completions")
    file = upload(client, path)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = finish(client, batch.id)
    assert batch.status == "completed", batch
    raw = client.batches.with_raw_response.retrieve(batch.id).content
    usage = Batch.model_validate(orjson.loads(raw)).usage  # openai's own type, validated
    bodies = [x["response"]["body"]["usage"] for x in lines_of(client, batch.output_file_id)]
    prompt = sum(b["prompt_tokens"] for b in bodies)
    generated = sum(b["completion_tokens"] for b in bodies)
    assert prompt == 30 * 3 and generated > 0
    assert usage.model_dump() == {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }
    with ResultsClient(client_address(broker.settings.completion.bind)) as results:
        totals = results.job_status(batch.id)["usage"]  # what `status JOB` reports
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (prompt, generated)


def test_the_driver_parses_an_input_file_once(fast, tmp_path, monkeypatch):
    """Validation's chunks are what is submitted: the file is not parsed a second time (in
    process: a driver of its own over the broker's ingest and completion ports)."""
    broker, _ = fast
    parses = []

    def counted(path, *args, **kwargs):
        parses.append(path)
        return iter_batch_input(path, *args, **kwargs)

    monkeypatch.setattr(batch_validation, "iter_batch_input", counted)
    monkeypatch.setattr(submit_client, "iter_batch_input", counted)
    root = tmp_path / "api"
    app = TestClient(make_app(broker.settings, root, ("/v1/embeddings",)))
    path = tmp_path / "in.jsonl"
    custom_ids = requests_file(path, 300, "/v1/embeddings")
    file = app.post("/v1/files", files={"file": path.read_bytes()}, data={"purpose": "batch"})
    body = {"input_file_id": file.json()["id"], "endpoint": "/v1/embeddings"}
    batch_id = app.post("/v1/batches", json=body).json()["id"]
    settings = broker.settings
    ingest = client_address(settings.ingest.bind)
    producers = (Producer(ingest), Producer(ingest))
    results = ResultsClient(client_address(settings.completion.bind))
    driver = batch_driver.BatchDriver(FileStore(root), BatchStore(root), producers, results)
    try:
        wait_for(
            lambda: driver.step(time.time())["completed"], "the batch to complete", timeout_s=120
        )
    finally:
        driver.close()
        results.close()
        for producer in producers:
            producer.close()
    batch = app.get(f"/v1/batches/{batch_id}").json()
    out = app.get(f"/v1/files/{batch['output_file_id']}/content").content.splitlines()
    assert_each_once([orjson.loads(x) for x in out], [], custom_ids)
    assert len(parses) == 1


def chunk_in_job(ingest: str, job_id: str, chunk: int) -> bool:
    """Whether chunk `chunk` of job `job_id` is committed within 30 s."""
    producer = Producer(ingest)
    try:
        committed = lambda: chunk in producer.job_status(job_id).get("committed", [])  # noqa: E731
        return wait_for(committed, f"chunk {chunk} of {job_id} in the job", timeout_s=30)
    except AssertionError:
        return False
    finally:
        producer.close()


def drive_one_batch(broker, tmp_path: Path, monkeypatch, at_chunk_3, until: str):
    """One 1,000-line batch (5 chunks) through a driver of its own over the broker's ingest
    and completion ports, in process; `at_chunk_3(batch_id, root)` runs on the validation's
    thread as it reads chunk 3. Returns (the batch object, its custom_ids) once `until`."""
    ingest = client_address(broker.settings.ingest.bind)
    made = {}

    def watched(path, *args, **kwargs):
        for chunk in iter_batch_input(path, *args, **kwargs):
            if chunk.index == 3:
                at_chunk_3(made["id"], root)
            yield chunk

    monkeypatch.setattr(batch_validation, "iter_batch_input", watched)
    root = tmp_path / "api"
    app = TestClient(make_app(broker.settings, root, ("/v1/embeddings",)))
    path = tmp_path / "in.jsonl"
    custom_ids = requests_file(path, 1000, "/v1/embeddings")
    file = app.post("/v1/files", files={"file": path.read_bytes()}, data={"purpose": "batch"})
    body = {"input_file_id": file.json()["id"], "endpoint": "/v1/embeddings"}
    made["id"] = app.post("/v1/batches", json=body).json()["id"]
    producers = (Producer(ingest), Producer(ingest))
    results = ResultsClient(client_address(broker.settings.completion.bind))
    driver = batch_driver.BatchDriver(FileStore(root), BatchStore(root), producers, results)
    try:
        wait_for(lambda: driver.step(time.time())[until], f"the batch to be {until}", timeout_s=120)
    finally:
        driver.close()
        results.close()
        for producer in producers:
            producer.close()
    batch = app.get(f"/v1/batches/{made['id']}").json()
    out = batch["output_file_id"] and app.get(f"/v1/files/{batch['output_file_id']}/content")
    return batch, custom_ids, [orjson.loads(x) for x in out.content.splitlines()] if out else []


def test_lines_are_sent_while_later_ones_are_still_checked(fast, tmp_path, monkeypatch):
    """Validation sends the chunks that checked out as the batch's job while it checks the
    rest (api/batch_validation.py): chunk 0 is in the job before chunk 3 is read."""
    broker, _ = fast
    seen = []

    def check(batch_id: str, root: Path) -> None:
        seen.append(chunk_in_job(client_address(broker.settings.ingest.bind), batch_id, 0))

    _, custom_ids, out = drive_one_batch(broker, tmp_path, monkeypatch, check, "completed")
    assert seen == [True]
    assert_each_once(out, [], custom_ids)


def test_a_batch_cancelled_while_its_lines_are_sent_ends_cancelled_and_so_does_its_job(
    fast, tmp_path, monkeypatch
):
    """Cancelled while validation sends its lines: the pass stops, the job is cancelled and
    sent the rest of the file, so it finishes (not left `validating` for ever) with every item
    retired."""
    broker, _ = fast
    ids = []

    def cancel(batch_id: str, root: Path) -> None:
        ids.append(batch_id)
        BatchStore(root).request_cancel(batch_id)

    batch, _, out = drive_one_batch(broker, tmp_path, monkeypatch, cancel, "cancelled")
    assert batch["status"] == "cancelled" and batch["in_progress_at"] is None and out == []
    results = ResultsClient(client_address(broker.settings.completion.bind))
    try:
        # cancelled; or completed, when its lines all ran before the cancel reached it
        ended = lambda: results.job_status(ids[0])["state"] in FINISHED  # noqa: E731
        wait_for(ended, "the batch's job to finish", timeout_s=60)
        job = results.job_status(ids[0])
    finally:
        results.close()
    assert job["total"] == job["completed"] + job["failed"] == 1000


def late_bad_line(path: Path, url: str = "/v1/embeddings", bad_url: str = "/v1/embeddings"):
    """1,000 good lines but line 901, past the first chunks; (good custom_ids, the bad one)."""
    good = requests_file(path, 1000, url)
    lines = path.read_bytes().splitlines(keepends=True)
    body = {"model": "nope" if bad_url == url else "echo", "prompt_token_ids": [1, 2]}
    bad = {"custom_id": "q900", "method": "POST", "url": bad_url, "body": body}
    lines[900] = orjson.dumps(bad) + b"\n"
    path.write_bytes(b"".join(lines))
    return good - {"q900"}, "q900"


def test_a_bad_line_after_lines_were_sent_fails_the_batch_and_cancels_its_job(fast, tmp_path):
    """The chunks before the bad line's were sent while it was checked: the batch fails as
    OpenAI's does (every bad line listed, no output file); its job is cancelled and sent the
    rest of the file, so that it finishes (a job never sent its last chunk never would)."""
    broker, client = fast
    late_bad_line(tmp_path / "in.jsonl")
    file = upload(client, tmp_path / "in.jsonl")
    made = client.batches.create(
        input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = finish(client, made.id)
    assert batch.status == "failed" and [e.line for e in batch.errors.data] == [901]
    assert batch.output_file_id is None and batch.error_file_id is None
    results = ResultsClient(client_address(broker.settings.completion.bind))
    try:
        ended = lambda: results.job_status(batch.id)["state"] in FINISHED  # noqa: E731
        wait_for(ended, "the batch's job to finish", timeout_s=60)
        job = results.job_status(batch.id)
    finally:
        results.close()
    assert job["total"] == job["completed"] + job["failed"] == 1000


def test_accept_partial_with_a_late_line_of_another_url_runs_every_other_line_once(fast, tmp_path):
    """The sending stops at the chunk with the line of another url; the job resumes from the
    copy of the file without it (the chunks already sent are the same there)."""
    _, client = fast
    good, bad = late_bad_line(tmp_path / "in.jsonl", bad_url="/v1/completions")
    file = upload(client, tmp_path / "in.jsonl")
    batch = finish(
        client,
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"fabric_accept_partial": "true"},
        ).id,
    )
    assert batch.status == "completed", batch
    out, err = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert_each_once(out, err, good | {bad})
    assert [e["custom_id"] for e in err] == [bad] and err[0]["error"]["code"] == "invalid_url"
    assert batch.request_counts.model_dump() == {"total": 1000, "completed": 999, "failed": 1}


def bad_file(path: Path) -> tuple[set[str], dict[int, str]]:
    """Ten good lines and four bad ones; (good custom_ids, {bad line number: code})."""
    good = {f"g{i}" for i in range(10)}
    lines = [
        {
            "custom_id": f"g{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [1, 2, 3]},
        }
        for i in range(10)
    ]
    lines.insert(
        2,
        {
            "custom_id": "b1",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "nope", "prompt_token_ids": [1]},
        },
    )
    lines.insert(
        5,
        {
            "custom_id": "b2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "echo", "prompt_token_ids": [1]},
        },
    )
    lines.insert(
        8,
        {
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [1]},
        },
    )
    lines.append(
        {
            "custom_id": "g0",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [1]},
        }
    )
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return good, {3: "", 6: "invalid_url", 9: "", 14: ""}


def test_a_file_with_bad_lines_fails_listing_every_one(fast, tmp_path):
    _, client = fast
    _, bad = bad_file(tmp_path / "bad.jsonl")
    file = upload(client, (tmp_path / "bad.jsonl"))
    batch = finish(
        client,
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        ).id,
    )
    assert batch.status == "failed" and batch.failed_at
    assert [e.line for e in batch.errors.data] == sorted(bad)
    assert all(e.code and e.message for e in batch.errors.data)
    assert batch.errors.data[1].code == "invalid_url" and batch.errors.data[1].param == "url"
    assert batch.output_file_id is None and batch.error_file_id is None


def test_accept_partial_keeps_good_lines_and_reports_bad_ones_as_error_lines(fast, tmp_path):
    _, client = fast
    good, bad = bad_file(tmp_path / "bad.jsonl")
    file = upload(client, (tmp_path / "bad.jsonl"))
    batch = finish(
        client,
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"fabric_accept_partial": "true"},
        ).id,
    )
    assert batch.status == "completed", batch
    out, err = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert {x["custom_id"] for x in out} == good
    assert len(err) == len(bad)
    assert {e["error"]["code"] for e in err} >= {"invalid_url"}
    assert batch.request_counts.model_dump() == {"total": 14, "completed": 10, "failed": 4}


def test_idempotency_key_retry_returns_the_same_batch_and_runs_it_once(fast, tmp_path):
    _, client = fast
    path = tmp_path / "in.jsonl"
    custom_ids = requests_file(path, 30, "/v1/embeddings")
    file = upload(client, path)
    headers = {"Idempotency-Key": "retry-me"}
    made = [
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            extra_headers=headers,
        )
        for _ in range(3)
    ]
    assert len({b.id for b in made}) == 1
    batch = finish(client, made[0].id)
    assert batch.status == "completed", batch
    assert_each_once(lines_of(client, batch.output_file_id), [], custom_ids)


def test_partial_output_while_in_progress_then_cancel_keeps_results(slow, tmp_path):
    broker, client = slow
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 500, seed=3)
    custom_ids = {f"r{i}" for i in range(500)}
    file = upload(client, path)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
    )

    def some_done():
        b = client.batches.retrieve(batch.id)
        return b if b.status == "in_progress" and b.request_counts.completed >= 20 else None

    running = wait_for(some_done, "some results", timeout_s=90, interval_s=0.3)
    raw = client.files.with_raw_response.content(running.output_file_id)
    assert raw.headers["X-Fabric-Partial"] == "true"
    partial = [orjson.loads(x) for x in raw.content.splitlines()]
    assert partial and raw.content.endswith(b"\n")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    ended = finish(client, batch.id)
    assert ended.status == "cancelled" and ended.cancelling_at and ended.cancelled_at
    out, err = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    assert_each_once(out, err, custom_ids)
    assert {x["custom_id"] for x in partial} <= {x["custom_id"] for x in out}
    assert out and err and {e["error"]["code"] for e in err} == {"cancelled"}
    final = client.files.with_raw_response.content(ended.output_file_id)
    assert final.headers["X-Fabric-Partial"] == "false"
    assert broker.job_status(batch.id)["state"] == "cancelled"  # as `status JOB` says it


def test_pause_and_resume_extensions_hold_a_batch_while_another_runs(slow, tmp_path):
    """POST /v1/batches/{id}/pause (an extension, sent with the official client's `post`):
    the batch stays `in_progress`, its metadata says fabric_paused, its queued lines wait
    while a second batch runs to the end; /resume lets them go, each line once. The
    metadata's fabric_priority is the job's priority; a bad one is refused at create."""
    broker, client = slow
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 200, seed=5)
    file = upload(client, path)
    with pytest.raises(openai.BadRequestError, match="fabric_priority"):
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"fabric_priority": "high"},
        )
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"fabric_priority": "2"},
    )

    def some_done():
        b = client.batches.retrieve(batch.id)
        return b if b.status == "in_progress" and b.request_counts.completed >= 20 else None

    wait_for(some_done, "some results", timeout_s=90, interval_s=0.3)
    paused = client.post(f"/batches/{batch.id}/pause", cast_to=Batch)
    assert paused.status == "in_progress" and paused.metadata["fabric_paused"] == "true"
    assert paused.metadata["fabric_priority"] == "2"

    def held():  # the job paused and its items in flight finished
        info = broker.job_status(batch.id)
        return info if info["paused"] and not info.get("in_flight") else None

    info = wait_for(held, "the job to be paused with nothing in flight", timeout_s=30)
    assert info["priority"] == 2 and info["pending"] > 0
    other_path = tmp_path / "other.jsonl"
    write_jsonl(other_path, 20, seed=6)
    other = client.batches.create(
        input_file_id=upload(client, other_path).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    assert finish(client, other.id).status == "completed"
    assert broker.job_status(batch.id)["completed"] == info["completed"]  # nothing more ran
    assert client.batches.retrieve(batch.id).status == "in_progress"
    resumed = client.post(f"/batches/{batch.id}/resume", cast_to=Batch)
    assert "fabric_paused" not in (resumed.metadata or {})
    ended = finish(client, batch.id)
    assert ended.status == "completed"
    out, err = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    assert_each_once(out, err, {f"r{i}" for i in range(200)})
    with pytest.raises(openai.ConflictError, match="Cannot pause"):
        client.post(f"/batches/{batch.id}/pause", cast_to=Batch)


def test_a_paused_batch_still_expires_at_its_expires_at(slow, tmp_path):
    """The deadline keeps running while a batch is paused: paused once it runs, it ends
    `expired` at the expires_at it was created with, its waiting lines `batch_expired`."""
    _, client = slow
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 300, seed=7)
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/embeddings", completion_window="6s"
    )

    def running():
        b = client.batches.retrieve(batch.id)
        return b if b.status == "in_progress" else None

    wait_for(running, "the batch to run", timeout_s=30, interval_s=0.2)
    paused = client.post(f"/batches/{batch.id}/pause", cast_to=Batch)
    assert paused.expires_at == batch.expires_at and paused.metadata["fabric_paused"] == "true"
    ended = finish(client, batch.id)
    assert ended.status == "expired" and ended.expired_at >= batch.expires_at
    assert "fabric_paused" not in (ended.metadata or {})
    out, err = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    assert_each_once(out, err, {f"r{i}" for i in range(300)})
    assert err and {e["error"]["code"] for e in err} == {"batch_expired"}


def job_state_at_each_door(broker: Broker, job_id: str, tmp_path: Path) -> dict[str, str]:
    """The job's state as each door names it: `status JOB` (its text and --json), a refresh
    of `status --watch JOB` on a pipe, and the last line of `results JOB`."""
    config = str(broker.config)
    said = {}
    text = run_cli("status", job_id, "--config", config)
    said["status"] = re.match(rf"job {job_id}: (\w+)\n", text.stdout)[1]
    said["status --json"] = orjson.loads(
        run_cli("status", job_id, "--json", "--config", config).stdout
    )["state"]
    fetched = run_cli("results", job_id, "-o", str(tmp_path / "late.jsonl"), "--config", config)
    said["results"] = re.search(r"; state (\w+),", fetched.stderr)[1]
    proc, pipe = on_pipe(watch_command(broker.config, job_id, "--plain", "--interval", "0.3"))
    try:
        wait_for(lambda: f"job {job_id} ".encode() in (pipe.read() or b""), "a refresh")
        assert interrupt(proc, pipe) == 0
    finally:
        pipe.close(proc)
    said["status --watch"] = re.search(rf"^job {job_id} (\w+) ", pipe.raw.decode(), re.M)[1]
    return said


def test_a_short_window_expires_keeping_results_made_and_every_door_says_expired(slow, tmp_path):
    """At expires_at the batch's job is cancelled at its deadline: the batch ends `expired`
    over HTTP, and `status JOB`, `status --watch` and `results` name its job `expired` too
    (one table: pipeline/core/job_states.py OPENAI_STATUS), not `cancelled`."""
    broker, client = slow
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 500, seed=4)
    custom_ids = {f"r{i}" for i in range(500)}
    file = upload(client, path)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/embeddings", completion_window="8s"
    )
    assert batch.expires_at == batch.created_at + 8
    ended = finish(client, batch.id)
    assert ended.status == "expired" and ended.expired_at >= ended.expires_at
    out, err = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    assert_each_once(out, err, custom_ids)
    assert err and {e["error"]["code"] for e in err} == {"batch_expired"}
    assert ended.request_counts.failed == len(err)
    for line in out:
        CreateEmbeddingResponse.model_validate(line["response"]["body"])
    assert set(job_state_at_each_door(broker, batch.id, tmp_path).values()) == {"expired"}
    again = tmp_path / "again.jsonl"  # the CLI door writes the same error codes as HTTP
    run_cli("results", batch.id, "--all", "-o", str(again), "--config", str(broker.config))
    errors_file = again.with_name("again.jsonl.errors.jsonl")
    cli_errors = [orjson.loads(line) for line in errors_file.read_text().splitlines()]
    assert {e["custom_id"]: e["error"]["code"] for e in cli_errors} == {
        e["custom_id"]: e["error"]["code"] for e in err
    }


def test_the_start_banner_lists_the_http_port(fast):
    broker, _ = fast
    said = broker.stderr_path.read_text()  # the terminal line is what this test is about
    bind = broker.settings.api.bind
    assert f"fabric:   OpenAI Batch API (HTTP)        {bind}  (api.bind)" in said, said


def test_the_stage_is_in_the_broker_and_keeps_serving_after_bad_input(fast):
    broker, client = fast
    assert {"api-0", "api-1"} <= set(broker.pids())
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.jsonl", b"not json\n"), purpose="batch")
    assert caught.value.body["code"] == "invalid_file_format"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h"
        )
    assert client.files.list().data is not None

    refused = 'fabric_api_requests_total{method="POST",route="/v1/files",status="400"}'

    def scraped():
        """Both figures: api-0 drives the batches, either process may have refused the file."""
        url = f"http://{broker.settings.metrics.bind}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        return 'fabric_api_batches{status="completed"}' in text and refused in text

    wait_for(scraped, "the api stage's metrics", timeout_s=30, interval_s=0.5)
