"""The demand signal and deadline answers through a real broker with one simulated worker
(6,000 tokens/s): `run.py status --json`, `GET /v1/fabric/demand` and the metrics show the same
per-model figures, in the shape a fleet controller reads; `submit --deadline` says on track or
at risk, `--deadline-strict` refuses a job that cannot make it before storing anything, and
`status JOB` and the HTTP batch show the live projection (docs/dispatch.md, "Demand and
deadlines"; docs/completion.md)."""

from __future__ import annotations

import urllib.request

import openai
import orjson
import pytest
from broker import submit, write_jsonl
from client_commands import run_cli
from conftest import wait_for
from test_api_broker import api_broker, requests_file, upload

from pipeline.core import exitcodes

FIELDS = {
    "workers_needed",
    "items_pending",
    "tokens_pending",
    "oldest_pending_age_s",
    "worker_items_per_s",
    "worker_tokens_per_s",
    "workers",
    "jobs_at_risk",
}


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    keys = 'engine = "simulated"\noptions = {tokens_per_s = 6000.0}'
    broker, url = api_broker(tmp_path_factory.mktemp("demand"), worker_keys=keys)
    try:
        yield broker, url
    finally:
        broker.close()


def http_demand(url: str) -> dict:
    request = urllib.request.Request(
        f"{url}/fabric/demand", headers={"Authorization": "Bearer any"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return orjson.loads(answer.read())


def test_status_json_the_http_route_and_the_metrics_show_the_demand(slow, tmp_path):
    broker, url = slow
    path = tmp_path / "in.jsonl"
    write_jsonl(path, 300)
    assert submit(broker.config, path).returncode == 0

    def measured():
        info = broker.broker_status()
        assert "echo" in info["demand"], (info["demand"], info["local_workers"])
        row = info["demand"]["echo"]
        return row if row["worker_items_per_s"] and row["items_pending"] > 0 else None

    row = wait_for(measured, "a measured rate while items are pending", timeout_s=60)
    assert set(row) == FIELDS
    assert row["workers"] == 1 and row["workers_needed"] >= 1 and row["tokens_pending"] > 0

    shown = orjson.loads(run_cli("status", "--json", "--config", str(broker.config)).stdout)
    assert set(shown["demand"]["echo"]) == FIELDS  # the command prints the same answer

    listed = http_demand(url)
    assert listed["object"] == "list"
    by_model = {entry["model"]: entry for entry in listed["data"]}
    assert set(by_model["echo"]) == FIELDS | {"model"} and by_model["echo"]["workers"] == 1
    assert broker.metric("fabric_worker_items_per_second", model="echo") > 0

    def drained():
        row = broker.broker_status()["demand"]["echo"]
        return row if row["items_pending"] == 0 and row["workers_needed"] == 0 else None

    idle = wait_for(drained, "the job to drain and the demand to fall to 0", timeout_s=120)
    assert idle["worker_items_per_s"] > 0  # the rate stays known while idle
    assert broker.metric("fabric_workers_needed", model="echo") in (0.0, 1.0)  # <= 1 s old


def measured_rate(broker, tmp_path) -> dict:
    """The echo model's demand row once its worker's rate is measured (a small job if needed)."""
    if not broker.broker_status()["demand"]["echo"]["worker_items_per_s"]:
        path = tmp_path / "warm.jsonl"
        write_jsonl(path, 60, seed=3)
        assert submit(broker.config, path).returncode == 0

    def known():
        row = broker.broker_status()["demand"]["echo"]
        return row if row["worker_items_per_s"] else None

    return wait_for(known, "the echo worker's measured rate", timeout_s=60)


def test_a_deadline_is_promised_or_refused_and_its_projection_shown_while_it_runs(slow, tmp_path):
    broker, url = slow
    rate = measured_rate(broker, tmp_path)["worker_items_per_s"]
    path = tmp_path / "big.jsonl"
    write_jsonl(path, 400, seed=7)
    assert 400 / rate > 5  # one worker takes longer than the 2 s asked for below

    refused = submit(
        broker.config, path, "--job-id", "hopeless", "--deadline", "2s", "--deadline-strict"
    )
    assert refused.returncode == exitcodes.DEADLINE_AT_RISK, refused.stderr
    assert "refused (--deadline-strict): at risk (projected" in refused.stderr
    assert "with 1 worker;" in refused.stderr and "would finish by" in refused.stderr
    assert not (broker.settings.data_path / "jobs" / "hopeless").exists()  # nothing stored

    kept = submit(broker.config, path, "--job-id", "roomy", "--deadline", "2h")
    assert kept.returncode == 0, kept.stderr
    assert "deadline: on track (projected " in kept.stderr

    def projected():
        return broker.job_status("roomy").get("deadline")

    row = wait_for(projected, "dispatch's projection of the job", timeout_s=30)
    assert row["measured"] is True and row["at_risk"] is False and row["workers"] == 1
    shown = run_cli("status", "roomy", "--config", str(broker.config)).stdout
    assert "  deadline   " in shown and ": on track (projected " in shown

    client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    requests = tmp_path / "requests.jsonl"
    requests_file(requests, 40, "/v1/embeddings")
    input_file = upload(client, requests).id
    before = {b.id for b in client.batches.list()}
    with pytest.raises(openai.BadRequestError) as refused_batch:  # behind "roomy": late
        client.batches.create(
            input_file_id=input_file,
            endpoint="/v1/embeddings",
            completion_window="1s",
            metadata={"fabric_deadline_strict": "true"},
        )
    assert refused_batch.value.code == "deadline_at_risk"
    assert "at risk (projected " in refused_batch.value.message
    assert {b.id for b in client.batches.list()} == before  # nothing was created
    batch = client.batches.create(
        input_file_id=input_file, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert (batch.metadata or {})["fabric_deadline_status"].startswith("on track (projected ")

    def live():  # it waits behind "roomy" (less slack): seconds of work ahead of it
        seen = client.batches.retrieve(batch.id)  # the official client's type validates it
        meta = seen.metadata or {}
        return meta if "fabric_deadline_status" in meta else None

    meta = wait_for(live, "the batch's projection in its metadata", timeout_s=60)
    assert meta["fabric_deadline_status"].startswith("on track (projected ")
    assert meta["fabric_deadline_at_risk"] == "false"
    assert int(meta["fabric_projected_finish_at"]) <= batch.expires_at
