"""The demand signal through a real broker: one simulated worker (6,000 tokens/s) works a job;
`run.py status --json`, `GET /v1/fabric/demand` and the metrics show the same per-model
figures, in the shape a fleet controller reads (docs/dispatch.md, "Demand and deadlines")."""

from __future__ import annotations

import urllib.request

import orjson
import pytest
from broker import submit, write_jsonl
from client_commands import run_cli
from conftest import wait_for
from test_api_broker import api_broker

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
