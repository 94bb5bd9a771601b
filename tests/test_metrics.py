"""Metrics: the catalogue's conventions, the supervisor's merging, and a real broker scraped.

The end-to-end test runs a broker with one local worker, scrapes its
Prometheus endpoint while it works and after, and checks the counters
against what it submitted, the worker computed and the client fetched; a
SIGKILLed stage shows in the restarts counter without resetting its
counters; and the data dir checks clean afterwards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import zygote
from broker import REPO, Broker, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import wait_for
from prometheus_client.parser import text_string_to_metric_families

from gpu.dispatch.arrivals import Arrivals
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.telemetry.metric_catalogue import COUNTER, FSYNC_BUCKETS_S, METRICS
from pipeline.telemetry.metrics import Histogram, encode_samples
from pipeline.telemetry.metrics_hub import MetricsHub
from pipeline.telemetry.metrics_server import valid_samples

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"fabric_[a-z][a-z0-9_]*[a-z0-9]")


# ---- the catalogue and the supervisor's merging, without processes ---------------------------
def test_names_follow_prometheus_conventions_and_the_docs_list_every_metric():
    docs = (ROOT / "docs" / "metrics.md").read_text()
    for name, metric in METRICS.items():
        assert NAME.fullmatch(name), name
        assert name.endswith("_total") == (metric.kind == COUNTER), name
        assert not re.search(r"_(ms|millis|secs?|kb|mb|gb|minutes)(_|$)", name), name
        assert f"| `{name}` | {metric.kind} |" in docs, f"docs/metrics.md lacks {name}"
        assert all(re.fullmatch(r"[a-z_]+", label) for label in metric.labels)
    listed = set(re.findall(r"^\| `(fabric_[a-z0-9_]+)` \|", docs, re.MULTILINE))
    assert listed == set(METRICS)


def test_a_stage_report_is_encoded_checked_and_refused_when_malformed():
    fsync = Histogram(FSYNC_BUCKETS_S)
    for seconds in (0.0001, 0.003, 0.003, 9.0):
        fsync.observe(seconds)
    samples = encode_samples(
        {
            "fabric_items_appended_total": {("echo", "64"): 5},
            "fabric_writer_fsync_seconds": fsync,
            "fabric_dead_letters_total": 2,
        }
    )
    assert valid_samples(samples) == samples
    assert samples[1][2][0][0] == 1 and samples[1][2][0][-1] == 1  # first bucket, +Inf
    assert valid_samples([["fabric_no_such_thing", [], 1]]) is None
    assert valid_samples([["fabric_dead_letters_total", ["x"], 1]]) is None
    assert valid_samples([["fabric_writer_fsync_seconds", [], [[1, 2], 0.1]]]) is None


def test_the_hub_keeps_counters_across_a_restart_and_ignores_a_dead_processes_report():
    hub = MetricsHub()
    hub.started("completion-0", 100)
    report = [
        ["fabric_items_completed_total", [], 40.0],
        ["fabric_worker_prompt_tokens_total", ["echo", "s1"], 7.0],  # the worker's own total
    ]
    assert hub.update("completion-0", 100, report)
    hub.ended("completion-0")  # killed
    assert not hub.update("completion-0", 100, report)  # a late report of the dead process
    hub.started("completion-0", 101)
    hub.update("completion-0", 101, [["fabric_items_completed_total", [], 2.0]])
    values, _ = hub.snapshot()
    assert values[("fabric_items_completed_total", ())] == 42.0
    assert ("fabric_worker_prompt_tokens_total", ("echo", "s1")) not in values
    assert hub.restarts() == {"completion-0": 1}
    assert hub.up() == {"completion-0": True}


def test_queue_age_comes_from_when_slots_became_durable():
    arrivals = Arrivals(resolution_s=1.0)
    arrivals.seen(7, 10, 1000.0)
    arrivals.seen(7, 20, 1000.5)  # within the resolution: the first mark grows
    arrivals.seen(7, 30, 1005.0)
    assert arrivals.arrived(7, 0) == arrivals.arrived(7, 19) == 1000.0
    assert arrivals.arrived(7, 25) == 1005.0
    assert arrivals.arrived(7, 30) is None
    arrivals.forget_below(7, 20)
    assert arrivals.marks(7) == 1 and arrivals.arrived(7, 25) == 1005.0


# ---- a real broker ---------------------------------------------------------------------------
def scrape(url: str) -> list | None:
    """Every sample at `url` as (name, labels, value), checked against the catalogue; None if
    the endpoint does not answer yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    samples = []
    for family in text_string_to_metric_families(text):
        metric = METRICS[family.name if family.type != "counter" else family.name + "_total"]
        assert family.type == metric.kind, family.name
        for sample in family.samples:
            if metric.kind == COUNTER:
                assert sample.name in (metric.name, metric.name.removesuffix("_total") + "_created")
            assert set(sample.labels) - {"le"} == set(metric.labels), sample
            samples.append((sample.name, sample.labels, sample.value))
    return samples


def value(samples: list, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels`."""
    return sum(
        v
        for n, have, v in samples
        if n == name and all(have.get(k) == x for k, x in labels.items())
    )


def scrape_when(url: str, what: str, check) -> list:
    """Scrape until `check(samples)` holds (waiting on a deadline); returns those samples."""

    def ready() -> list | None:
        samples = scrape(url)
        return samples if samples is not None and check(samples) else None

    return wait_for(ready, what)


def run_py(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`run.py ARGS`, run in this process (tests/client_commands.py)."""
    return run_cli(*args)


def test_a_scrape_during_and_after_a_run_matches_what_was_submitted_and_retired(tmp_path):
    n = 1000
    config = write_config(tmp_path, workers=0, dispatch="report_s = 0.3")
    b = Broker(config)
    url = f"http://{b.settings.metrics.bind}/metrics"
    data = tmp_path / "in.jsonl"
    write_jsonl(data, n)
    lengths = [
        len(json.loads(line)["body"]["prompt_token_ids"]) for line in data.read_text().splitlines()
    ]
    by_lane = Counter(b.settings.broker.lane_for(length) for length in lengths)
    worker = None
    try:
        b.start()
        up = wait_for(lambda: scrape(url), "the metrics endpoint to answer")
        assert value(up, "fabric_stage_up", stage="dispatch-0") == 1
        assert value(up, "fabric_stage_restarts_total") == 0
        result = submit(b.config, data, "--job-id", "m")
        assert result.returncode == 0, result.stderr

        # No worker yet: everything acknowledged is appended and waits, per model and lane.
        queued = scrape_when(
            url,
            "the writer and dispatch to count the items",
            lambda s: (
                value(s, "fabric_queued_items") == n
                and value(s, "fabric_items_appended_total") == n
            ),
        )
        for lane, count in by_lane.items():
            assert value(queued, "fabric_queued_items", model="echo", lane=str(lane)) == count
            assert value(queued, "fabric_items_appended_total", lane=str(lane)) == count
        assert value(queued, "fabric_queued_tokens") == sum(k * c for k, c in by_lane.items())
        assert value(queued, "fabric_items_appended_total", model="echo") == n
        assert value(queued, "fabric_writer_fsync_seconds_count") >= 1
        assert value(queued, "fabric_worker_sessions", model="echo") == 0
        scrape_when(
            url,
            "the oldest waiting item to be over a second old",
            lambda s: value(s, "fabric_oldest_queued_item_age_seconds", model="echo") > 1,
        )

        # A worker works through it.
        dispatch = b.settings.dispatch
        options = WorkerOptions(
            broker=dispatch.bind, model="echo", heartbeat=dispatch.heartbeat_bind, engine="echo"
        )
        worker = zygote.Popen(
            [sys.executable, "run.py", "worker", *options.argv()],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        done = scrape_when(
            url,
            "every item to be dispatched and completed",
            lambda s: (
                value(s, "fabric_items_completed_total") == n
                and value(s, "fabric_items_dispatched_total") == n
            ),
        )
        assert value(done, "fabric_items_dispatched_total", model="echo") == n
        assert value(done, "fabric_worker_sessions", model="echo") == 1
        out = tmp_path / "out.jsonl"
        fetched = run_py("results", "m", "-o", str(out), "--config", str(config))
        assert fetched.returncode == 0, fetched.stderr
        assert len(out.read_text().splitlines()) == n

        # After the run: delivered, nothing waits or is out, no reclaim, no duplicate.
        after = scrape_when(
            url,
            "delivery, the worker's token report and its leases to settle",
            lambda s: (
                value(s, "fabric_results_delivered_total") == n
                and value(s, "fabric_worker_prompt_tokens_total", model="echo") == sum(lengths)
                and value(s, "fabric_worker_in_flight_items") == 0
                and value(s, "fabric_queued_items") == 0
            ),
        )
        assert value(after, "fabric_worker_leases") == 0
        assert value(after, "fabric_queued_tokens") == 0
        assert value(after, "fabric_oldest_queued_item_age_seconds", model="echo") == 0
        assert value(after, "fabric_items_reclaimed_total") == 0
        assert value(after, "fabric_dead_letters_total") == 0
        assert value(after, "fabric_duplicate_results_total") == 0
        assert value(after, "fabric_worker_engine_tokens_per_second", model="echo") > 0
        assert value(after, "fabric_worker_idle_seconds_total", model="echo") > 0
        assert value(after, "fabric_segment_files", log="input") >= 1
        assert value(after, "fabric_segment_bytes", log="completion") > 0
        assert value(after, "fabric_disk_free_bytes") > 0

        # A stage SIGKILLed: its restart is counted, and its counters carry on from where they were.
        b.kill_stage("completion-0")
        restarted = scrape_when(
            url,
            "the completion stage's restart to be counted",
            lambda s: (
                value(s, "fabric_stage_restarts_total", stage="completion-0") == 1
                and value(s, "fabric_stage_up", stage="completion-0") == 1
            ),
        )
        assert value(restarted, "fabric_stage_restarts_total") == 1
        assert value(restarted, "fabric_items_completed_total") == n
        assert value(restarted, "fabric_results_delivered_total") == n

        worker.terminate()  # it drains and says BYE: its session goes
        assert worker.wait(timeout=30) == exitcodes.OK
        gone = scrape_when(
            url,
            "the worker's session to end",
            lambda s: value(s, "fabric_worker_sessions", model="echo") == 0,
        )
        assert value(gone, "fabric_worker_leases") == 0
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        b.close()
    check = run_py("check", "--config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
