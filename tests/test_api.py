"""The HTTP API's routes in process (FastAPI's TestClient, no broker): files, batch records,
keys and owners, OpenAI's error bodies, bad input. tests/test_api_broker.py runs the whole
flow against a real broker with the openai client; tests/test_api_crash.py kills it."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from pathlib import Path

import orjson
import pytest
from fastapi.testclient import TestClient

from api import upload as upload_module
from api.app import PARTIAL_HEADER, make_app, parse_window
from api.batch_store import BatchStore
from api.errors import ApiError
from api.file_store import PURPOSE_OUTPUT, FileRecord, FileStore, output_file_id
from api.retention import OutputRetention
from api.upload import JsonlChecker
from config import load_settings
from pipeline.core.errors import ConfigError
from pipeline.core.job_states import BatchStatus
from pipeline.store.job_files import JobFiles
from pipeline.transport.security import check_exposure

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
KEYS = {"key-a": "team-a", "key-b": "team-b"}


def settings_for(tmp_path: Path, api: dict | None = None):
    return load_settings(
        None,
        {
            "broker": {"data_dir": str(tmp_path / "data")},
            "api": {"enabled": True, **(api or {})},
            "models": [{"name": "echo", "engine": "echo"}],
        },
    )


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "api_keys"
    lines = [f"{hashlib.sha256(k.encode()).hexdigest()} {o}" for k, o in KEYS.items()]
    path.write_text("# test keys\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "data" / "api"


@pytest.fixture
def client(tmp_path, root) -> TestClient:
    settings = settings_for(tmp_path, {"keys_file": str(keys_file(tmp_path))})
    return TestClient(make_app(settings, root, ENDPOINTS), raise_server_exceptions=False)


def auth(key: str = "key-a") -> dict:
    return {"Authorization": f"Bearer {key}"}


def line(i: int, url: str = "/v1/embeddings") -> bytes:
    body = {"model": "echo", "prompt_token_ids": [1, 2, i + 3]}
    return orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})


def jsonl(n: int) -> bytes:
    return b"".join(line(i) + b"\n" for i in range(n))


def upload(client, data: bytes, key: str = "key-a", purpose: str = "batch"):
    return client.post(
        "/v1/files",
        headers=auth(key),
        data={"purpose": purpose},
        files={"file": ("in.jsonl", data, "application/jsonl")},
    )


def assert_openai_error(response, status: int, param: str | None = "unset") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param != "unset":
        assert error["param"] == param
    return error


def stored(root: Path) -> list[str]:
    """Every name in the file store (records, bytes, uploads under way)."""
    files = root / "files"
    return sorted(p.name for p in files.iterdir()) if files.exists() else []


def test_upload_is_an_openai_file_object_and_its_content_is_byte_identical(client, root):
    from openai.types import FileObject

    data = jsonl(50)
    answer = upload(client, data)
    assert answer.status_code == 200, answer.text
    file = FileObject.model_validate(answer.json())
    assert set(answer.json()) == set(FileObject.model_fields)
    assert (file.bytes, file.purpose, file.filename, file.object) == (
        len(data),
        "batch",
        "in.jsonl",
        "file",
    )
    assert file.expires_at == file.created_at + 30 * 24 * 3600
    for _ in range(2):
        content = client.get(f"/v1/files/{file.id}/content", headers=auth())
        assert content.content == data
        assert content.headers[PARTIAL_HEADER] == "false"
    assert client.get(f"/v1/files/{file.id}", headers=auth()).json() == answer.json()
    assert stored(root) == [f"{file.id}.data", f"{file.id}.json"]


def test_files_list_pages_filters_and_orders(client):
    ids = [upload(client, jsonl(2)).json()["id"] for _ in range(5)]
    upload(client, jsonl(2), key="key-b")  # another owner's: never listed
    listed = client.get("/v1/files", headers=auth(), params={"order": "asc"}).json()
    assert [f["id"] for f in listed["data"]] == sorted(
        ids, key=lambda i: (client.get(f"/v1/files/{i}", headers=auth()).json()["created_at"], i)
    )
    seen, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = client.get("/v1/files", headers=auth(), params=params).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    assert (
        client.get("/v1/files", headers=auth(), params={"purpose": "batch_output"}).json()["data"]
        == []
    )
    assert_openai_error(client.get("/v1/files", headers=auth(), params={"limit": 0}), 400, "limit")
    assert_openai_error(
        client.get("/v1/files", headers=auth(), params={"order": "up"}), 400, "order"
    )


def test_delete_removes_the_file_and_its_bytes(client, root):
    file_id = upload(client, jsonl(3)).json()["id"]
    answer = client.delete(f"/v1/files/{file_id}", headers=auth())
    assert answer.json() == {"id": file_id, "object": "file", "deleted": True}
    assert_openai_error(client.get(f"/v1/files/{file_id}", headers=auth()), 404)
    assert stored(root) == []


@pytest.mark.parametrize(
    ("data", "purpose", "param"),
    [
        (b"this is not json\n", "batch", "file"),
        (b"[1, 2]\n", "batch", "file"),
        (jsonl(3) + b"{broken\n", "batch", "file"),
        (b"", "batch", "file"),
        (b"\n\n", "batch", "file"),
        (jsonl(3), "fine-tune", "purpose"),
        (jsonl(3), "", "purpose"),
    ],
    ids=["not-json", "not-object", "bad-last-line", "empty", "blank", "purpose", "no-purpose"],
)
def test_bad_uploads_are_refused_and_nothing_is_stored(client, root, data, purpose, param):
    assert_openai_error(upload(client, data, purpose=purpose), 400, param)
    assert stored(root) == []
    assert upload(client, jsonl(1)).status_code == 200  # and it keeps serving


def test_a_body_that_is_not_multipart_or_cut_off_is_refused(client, root):
    answer = client.post(
        "/v1/files", headers={**auth(), "Content-Type": "application/json"}, content=b"{}"
    )
    assert assert_openai_error(answer, 400)["code"] == "invalid_multipart"
    whole = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + jsonl(20) + b"\r\n--XyZ--\r\n"
    )
    headers = {**auth(), "Content-Type": "multipart/form-data; boundary=XyZ"}
    cut = client.post("/v1/files", headers=headers, content=whole[: len(whole) // 2])
    assert assert_openai_error(cut, 400)["code"] == "invalid_multipart"
    assert stored(root) == []
    assert client.post("/v1/files", headers=headers, content=whole).status_code == 200


def test_an_upload_over_the_limit_answers_413(tmp_path, root):
    settings = settings_for(tmp_path, {"max_upload_bytes": 1000})
    client = TestClient(make_app(settings, root, ENDPOINTS))
    assert upload(client, jsonl(5)).status_code == 200
    assert assert_openai_error(upload(client, jsonl(100)), 413)["code"] == "file_too_large"
    assert len(stored(root)) == 2


def test_keys_and_owners(client):
    file_id = upload(client, jsonl(2)).json()["id"]
    assert assert_openai_error(client.get("/v1/files"), 401)["code"] == "invalid_api_key"
    assert_openai_error(client.get("/v1/files", headers=auth("wrong")), 401)
    assert_openai_error(client.get(f"/v1/files/{file_id}", headers=auth("key-b")), 404)
    assert_openai_error(client.get(f"/v1/files/{file_id}/content", headers=auth("key-b")), 404)
    assert_openai_error(client.delete(f"/v1/files/{file_id}", headers=auth("key-b")), 404)
    other = client.post(
        "/v1/batches",
        headers=auth("key-b"),
        json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
    )
    assert_openai_error(other, 404, "input_file_id")
    batch = create(client, file_id)
    assert_openai_error(client.get(f"/v1/batches/{batch['id']}", headers=auth("key-b")), 404)
    assert_openai_error(
        client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth("key-b")), 404
    )
    assert client.get("/v1/batches", headers=auth("key-b")).json()["data"] == []


def test_loopback_without_a_keys_file_serves_everyone_as_one_owner(tmp_path, root):
    client = TestClient(make_app(settings_for(tmp_path), root, ENDPOINTS))
    file_id = client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", jsonl(2))}
    ).json()["id"]
    assert client.get(f"/v1/files/{file_id}", headers=auth("anything")).status_code == 200


def test_binding_beyond_loopback_without_keys_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"api\.bind"):
        check_exposure(settings_for(tmp_path, {"bind": "0.0.0.0:8000"}))
    keyed = {"bind": "0.0.0.0:8000", "keys_file": str(keys_file(tmp_path))}
    assert check_exposure(settings_for(tmp_path, keyed)) == []
    assert check_exposure(settings_for(tmp_path, {"bind": "127.0.0.1:8000"})) == []


def create(client, file_id: str, key: str = "key-a", headers: dict | None = None, **extra):
    body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    answer = client.post("/v1/batches", headers={**auth(key), **(headers or {})}, json=body | extra)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_created_batch_is_an_openai_batch_validating_with_its_deadline(client):
    from openai.types import Batch

    file_id = upload(client, jsonl(2)).json()["id"]
    batch = create(client, file_id, metadata={"project": "x"})
    assert set(batch) == set(Batch.model_fields)
    parsed = Batch.model_validate(batch)
    assert parsed.status == "validating"
    assert parsed.expires_at == parsed.created_at + 24 * 3600
    assert parsed.metadata == {"project": "x"}
    short = create(client, file_id, completion_window="90s")
    assert short["expires_at"] == short["created_at"] + 90
    assert client.get(f"/v1/batches/{batch['id']}", headers=auth()).json() == batch


def test_idempotency_key_returns_the_same_batch_and_survives_a_new_app(client, tmp_path, root):
    file_id = upload(client, jsonl(2)).json()["id"]
    first = create(client, file_id, headers={"Idempotency-Key": "k1"})
    assert create(client, file_id, headers={"Idempotency-Key": "k1"}) == first
    settings = settings_for(tmp_path, {"keys_file": str(keys_file(tmp_path))})
    again = TestClient(make_app(settings, root, ENDPOINTS))  # a restarted stage
    assert create(again, file_id, headers={"Idempotency-Key": "k1"}) == first
    assert create(again, file_id, headers={"Idempotency-Key": "k2"})["id"] != first["id"]
    other_file = upload(client, jsonl(3)).json()["id"]
    reused = client.post(
        "/v1/batches",
        headers={**auth(), "Idempotency-Key": "k1"},
        json={"input_file_id": other_file, "endpoint": "/v1/embeddings"},
    )
    assert assert_openai_error(reused, 409)["code"] == "idempotency_key_reused"
    assert len(client.get("/v1/batches", headers=auth()).json()["data"]) == 2


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/images"}, "endpoint"),
        ({"completion_window": "soon"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"metadata": {"a": 1}}, "metadata"),
    ],
)
def test_bad_batch_requests(client, change, param):
    file_id = upload(client, jsonl(2)).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    answer = client.post("/v1/batches", headers=auth(), json=body | change)
    assert_openai_error(answer, 404 if param == "input_file_id" else 400, param)
    assert client.get("/v1/batches", headers=auth()).json()["data"] == []
    bad_json = client.post("/v1/batches", headers=auth(), content=b"not json")
    assert_openai_error(bad_json, 400)


def test_batches_list_pages_newest_first(client):
    file_id = upload(client, jsonl(2)).json()["id"]
    ids = [create(client, file_id)["id"] for _ in range(5)]
    seen, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = client.get("/v1/batches", headers=auth(), params=params).json()
        seen += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert sorted(seen) == sorted(ids)


def test_cancel_shows_cancelling_at_once_and_a_finished_batch_refuses(client, root):
    file_id = upload(client, jsonl(2)).json()["id"]
    batch = create(client, file_id)
    answer = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth()).json()
    assert answer["status"] == "cancelling" and answer["cancelling_at"]
    store = BatchStore(root)
    record = store.get(batch["id"])
    record.move_to(BatchStatus.COMPLETED, 1)
    store.put(record)
    refused = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth())
    assert_openai_error(refused, 409)


def test_output_files_expire_with_the_job_or_with_a_batch_that_had_none(client, root):
    """A batch that never ran a job: its files expire from its end; one whose job finished:
    from the job's finished mark; one still running: not yet known."""
    file_id = upload(client, jsonl(2)).json()["id"]
    store, files = BatchStore(root), FileStore(root)
    now = time.time()
    ids = [create(client, file_id)["id"] for _ in range(3)]
    ended = [
        {"status": BatchStatus.FAILED, "failed_at": int(now) - 100},  # no job
        {
            "status": BatchStatus.COMPLETED,
            "in_progress_at": int(now) - 5,
            "completed_at": int(now),
        },
        {"status": BatchStatus.IN_PROGRESS, "in_progress_at": int(now) - 5},
    ]
    for batch_id, change in zip(ids, ended, strict=True):
        store.put(dataclasses.replace(store.get(batch_id), **change))
        store.path(batch_id, "error.jsonl").write_bytes(b'{"custom_id": "r0"}\n')
        record = FileRecord(
            id=output_file_id(batch_id, "error"),
            owner="team-a",
            bytes=20,
            created_at=int(now),
            filename="e.jsonl",
            purpose=PURPOSE_OUTPUT,
            path=f"batches/{batch_id}/error.jsonl",
            batch_id=batch_id,
        )
        files.put(record)
    jobs = JobFiles(root.parent)
    jobs.directory(ids[1]).mkdir(parents=True)
    jobs.mark_finished(ids[1], int(now * 1e9))
    retention = OutputRetention(files, store, root.parent, retention_s=50)
    error_ids = [output_file_id(b, "error") for b in ids]
    assert retention.step(now) == [error_ids[0]]  # ended 100 s ago: 50 s past its retention
    assert_openai_error(client.get(f"/v1/files/{error_ids[0]}", headers=auth()), 404, "id")
    assert not store.path(ids[0], "error.jsonl").exists()
    shown = client.get(f"/v1/files/{error_ids[1]}", headers=auth()).json()
    assert shown["expires_at"] == math.ceil(now + 50)
    assert client.get(f"/v1/files/{error_ids[2]}", headers=auth()).json()["expires_at"] is None
    assert retention.step(now + 49) == []
    assert retention.step(now + 51) == [error_ids[1]]
    listed = {f["id"] for f in client.get("/v1/files", headers=auth()).json()["data"]}
    assert listed == {file_id, error_ids[2]}
    assert client.get(f"/v1/batches/{ids[1]}", headers=auth()).json()["status"] == "completed"


def test_unknown_routes_answer_in_openai_shape(client):
    assert_openai_error(client.get("/v1/nothing", headers=auth()), 404)


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/files/file-%00x"),
        ("GET", "/v1/files/file-%00x/content"),
        ("DELETE", "/v1/files/file-%00x"),
        ("GET", "/v1/batches/batch_%00x"),
        ("POST", "/v1/batches/batch_%00x/cancel"),
    ],
)
def test_an_id_with_a_nul_byte_is_no_such_object(client, method, path):
    """An id that no store could have made (a NUL byte) is a 404, as any unknown id;
    it was a 500 (the NUL reached the file system's path)."""
    assert_openai_error(client.request(method, path, headers=auth()), 404, "id")


def test_window_parsing():
    assert parse_window("24h") == 86400
    assert parse_window("30s") == 30 and parse_window("10m") == 600 and parse_window("2d") == 172800
    for bad in ("24", "h", "1.5h", "-1h", 24, None, "0s"):
        with pytest.raises(ApiError):
            parse_window(bad)


def test_sweep_removes_what_a_crash_left_half_way(root):
    store = FileStore(root)
    ok = store.upload_path()
    ok.write_bytes(jsonl(1))
    kept = store.commit_upload(ok, "o", "a.jsonl", len(jsonl(1)), 10)
    store.upload_path().write_bytes(b"half an upload")  # killed while it arrived
    (store.files / "file-orphan.data").write_bytes(b"x")  # renamed, record never written
    assert store.sweep() == 2
    assert sorted(os.listdir(store.files)) == [f"{kept.id}.data", f"{kept.id}.json"]


def test_only_the_head_of_an_upload_is_parsed_and_a_line_cut_by_its_end_is_no_error():
    """Lines past the first MiB are not parsed as they arrive (batch validation names them)."""
    data = jsonl(12000) + b"{not json past the head\n"  # about 1.1 MiB
    checker = JsonlChecker()
    for start in range(0, len(data), 65536):  # as a socket delivers it
        checker.feed(data[start : start + 65536])
    checker.finish()
    assert 0 < checker.number < 12000
    with pytest.raises(ApiError):
        whole = JsonlChecker(check_bytes=len(data))
        whole.feed(data)
        whole.finish()


def test_an_upload_fed_in_odd_pieces_past_several_writeback_steps_is_stored_whole(
    tmp_path, monkeypatch
):
    """The file part is written from views of each chunk as it lies, the disk asked to start
    writing every WRITEBACK_BYTES: the stored bytes are the file's, whatever the pieces."""
    monkeypatch.setattr(upload_module, "WRITEBACK_BYTES", 1 << 16)
    data = jsonl(4000)  # about 300 KB: several writeback steps
    body = (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        + data
        + b"\r\n--B--\r\n"
    )
    parser = upload_module.UploadParser("multipart/form-data; boundary=B", tmp_path / "up", 1 << 30)
    for start in range(0, len(body), 7919):  # pieces that cut lines and the boundary
        parser.feed(body[start : start + 7919])
    parser.finish()
    parser.sync()
    parser.close()
    assert (tmp_path / "up").read_bytes() == data
    assert (parser.size, parser.fields, parser.filename) == (
        len(data),
        {"purpose": b"batch"},
        "a.jsonl",
    )


def test_requests_are_counted_per_route_template(client):
    file_id = upload(client, jsonl(2)).json()["id"]
    client.get(f"/v1/files/{file_id}", headers=auth())
    client.get("/v1/files/file-nope", headers=auth())
    stats = client.app.state.route_stats.stats()
    requests = stats["fabric_api_requests_total"]
    assert requests[("/v1/files", "POST", "200")] == 1
    assert requests[("/v1/files/{file_id}", "GET", "200")] == 1
    assert requests[("/v1/files/{file_id}", "GET", "404")] == 1
    assert stats["fabric_api_request_seconds_total"][("/v1/files/{file_id}", "GET")] > 0
    from pipeline.telemetry.metrics import encode_samples

    assert encode_samples(stats)  # the catalogue takes them
