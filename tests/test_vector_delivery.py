"""Embeddings delivered to the vector store by a real broker, under kills; search, export, check.

Every test submits a real job with `--deliver vectors...`, lets a local
worker (the simulated engine: deterministic 384-dim embeddings of the
tokens) embed it, and reads the store back through `run.py vectors`. The
count that matters: every item has exactly one outcome, a stored vector (its
id unique in the store) or an error line, whatever was killed on the way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from broker import WORDS, Broker, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from collector.vectors.shard import shard_paths
from collector.vectors.vector_rows import IDS_DTYPE
from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.errors import FabricError
from pipeline.transport.security import client_curve
from pipeline.transport.topology import client_address

NEEDLE = "w5 w6 w7 w8"
SIM_WORKER = 'model = "sim"\nsimulated_tokens_per_s = 5e6\nbatch_items = 64\ntarget_batch_s = 0'


def write_texts(path: Path, n: int, seed: int = 0, bad_every: int = 0) -> int:
    """n embedding lines of text for `sim` (line 3 is NEEDLE); returns how many are valid."""
    rng = np.random.default_rng(seed)
    valid = 0
    with open(path, "w") as out:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                out.write('{"custom_id": "broken", "method": \n')
                continue
            text = NEEDLE if i == 3 else " ".join(rng.choice(WORDS, int(rng.integers(3, 30))))
            line = {
                "custom_id": f"t{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "sim", "input": text},
            }
            out.write(json.dumps(line) + "\n")
            valid += 1
    return valid


def cli(config: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`run.py ARGS --config CONFIG`, run in this process (tests/client_commands.py)."""
    return run_cli(*args, "--config", str(config))


def stats(config: Path) -> dict:
    done = cli(config, "vectors", "stats", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def store_rows(config: Path, name: str) -> int:
    """Rows of store `name`, as `vectors stats --json` lists them, asked in-process (tests poll
    it: a command per poll costs an interpreter); 0 while the vectors stage is being restarted
    (nothing listens)."""
    from collector.vectors.client import VectorsClient

    settings = load_settings(config)
    address = client_address(settings.vectors.bind)
    try:
        with VectorsClient(
            address, timeout_s=2.0, attempts=1, curve=client_curve(settings.security)
        ) as client:
            stores = client.stats()["stores"]
    except FabricError:
        return 0
    return next((store["rows"] for store in stores if store["name"] == name), 0)


def delivered(b: Broker, job: str) -> bool:
    return (b.data_dir.root / "vectors" / "delivered" / job).exists()


@pytest.fixture
def broker(tmp_path):
    started: list[Broker] = []

    def start(vectors: str = "", worker_keys: str = SIM_WORKER) -> Broker:
        config = write_config(tmp_path, workers=1, worker_keys=worker_keys, vectors=vectors)
        b = Broker(config).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


def outcomes(b: Broker, store: str, job: str) -> tuple[list[str], list[str]]:
    """(custom_ids of the store's vectors from `job`, custom_ids of the job's error lines)."""
    out = b.config.parent / f"{store}.npy"
    done = cli(b.config, "vectors", "export", "--store", store, "-o", str(out))
    assert done.returncode == 0, done.stderr
    stored = [json.loads(line) for line in Path(f"{out}.ids.jsonl").read_text().splitlines()]
    assert len(stored) == len(np.load(out))
    errors_path = b.data_dir.root / "vectors" / "errors" / f"{job}.jsonl"
    lines = errors_path.read_text().splitlines() if errors_path.exists() else []
    errors = [json.loads(line)["custom_id"] for line in lines]
    return [s["custom_id"] for s in stored if s["job"] == job], errors


def test_a_job_lands_in_the_store_and_a_text_search_finds_it(broker, tmp_path):
    b = broker()
    path = tmp_path / "in.jsonl"
    valid = write_texts(path, 600, bad_every=50)
    done = submit(b.config, path, "--job-id", "emb", "--deliver", "vectors:docs")
    assert done.returncode == 0, done.stderr
    wait_for(lambda: delivered(b, "emb"), "the job to be delivered to the store", timeout_s=90)
    assert store_rows(b.config, "docs") == valid
    stored, errors = outcomes(b, "docs", "emb")
    assert len(stored) == len(set(stored)) == valid
    assert errors == [None] * 12  # the broken lines (no custom_id): rejected, one error line each

    hits = cli(
        b.config, "vectors", "search", "--store", "docs", "--text", NEEDLE, "-k", "3", "--json"
    )
    assert hits.returncode == 0, hits.stderr
    top = [json.loads(line) for line in hits.stdout.splitlines()]
    assert top[0]["custom_id"] == "t3" and top[0]["job"] == "emb"
    assert top[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert [h["rank"] for h in top] == [1, 2, 3]

    query = tmp_path / "q.npy"
    np.save(query, np.load(tmp_path / "docs.npy")[10])
    hits = cli(
        b.config, "vectors", "search", "--store", "docs", "--vector-file", str(query), "--json"
    )
    assert json.loads(hits.stdout.splitlines()[0])["score"] == pytest.approx(1.0, abs=1e-4)

    parquet = tmp_path / "docs.parquet"
    done = cli(b.config, "vectors", "export", "--store", "docs", "-o", str(parquet))
    assert done.returncode == 0, done.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(parquet)
    assert table.num_rows == valid
    assert sorted(table.column("custom_id").to_pylist()) == sorted(stored)
    assert len(table.column("embedding")[0]) == 384

    # The results file route is closed for a vectors job, and says where to look instead.
    fetched = cli(b.config, "results", "emb", "-o", str(tmp_path / "out.jsonl"))
    assert fetched.returncode != 0 and "vector store" in fetched.stderr
    # ... but --all still reads every result (as well as the store), within retention.
    fetched = cli(b.config, "results", "emb", "-o", str(tmp_path / "all.jsonl"), "--all")
    assert fetched.returncode == 0, fetched.stderr
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == valid

    running = cli(b.config, "check")  # never against a running broker (its stores are open)
    assert running.returncode != 0 and "in use by pid" in running.stderr
    assert b.stop() == exitcodes.OK
    assert_check_clean(b.data_dir)


@pytest.mark.slow
def test_sigkill_of_the_vector_stage_and_the_broker_loses_and_doubles_nothing(broker, tmp_path):
    # a worker slow enough (about 10 s of work for the job: 300 lines a second) that delivery
    # cannot outrun the kills, however long a `vectors stats` poll takes (2e4 could: 2 kills)
    slow = SIM_WORKER.replace("simulated_tokens_per_s = 5e6", "simulated_tokens_per_s = 5e3")
    b = broker("flush_ms = 50.0\npage_items = 64", worker_keys=slow)
    path = tmp_path / "in.jsonl"
    valid = write_texts(path, 3000, seed=1)
    done = submit(b.config, path, "--job-id", "kills", "--deliver", "vectors")
    assert done.returncode == 0, done.stderr
    kills = 0
    for target in (200, 600, 1000):  # kill mid-delivery: the stage, the broker, the stage
        wait_for(
            lambda t=target, b=b: store_rows(b.config, "sim") >= t or delivered(b, "kills"),
            f"{target} rows stored",
            timeout_s=60,
        )
        if delivered(b, "kills"):
            break
        if kills % 2:
            b.kill()
            b = Broker(b.config).start()
        else:
            b.kill_stage("vectors-0")
        kills += 1
    assert kills >= 3
    wait_for(lambda: delivered(b, "kills"), "the job to be delivered", timeout_s=120)
    stored, errors = outcomes(b, "sim", "kills")
    assert errors == []
    assert len(stored) == len(set(stored)) == valid  # every item once: none lost, none doubled
    assert b.stop() == exitcodes.OK
    assert_check_clean(b.data_dir)


def test_a_damaged_store_is_reported_never_served_and_check_finds_it(broker, tmp_path):
    b = broker()
    path = tmp_path / "in.jsonl"
    write_texts(path, 200, seed=2)
    assert submit(b.config, path, "--job-id", "j1", "--deliver", "vectors:docs").returncode == 0
    wait_for(lambda: delivered(b, "j1"), "the job to be delivered", timeout_s=60)
    assert b.stop() == exitcodes.OK
    _payload, ids, _ = shard_paths(b.data_dir.root / "vectors" / "docs", 0)
    os.truncate(ids, os.path.getsize(ids) - 3 * IDS_DTYPE.itemsize)  # acknowledged rows lost

    check = cli(b.config, "check")
    assert check.returncode != 0
    assert "vector-shard-damaged" in check.stdout + check.stderr

    b2 = Broker(b.config).start()
    answer = stats(b.config)
    docs = next(s for s in answer["stores"] if s["name"] == "docs")
    assert docs["served"] is False and "acknowledged" in docs["reason"]
    hits = cli(b.config, "vectors", "search", "--store", "docs", "--text", NEEDLE)
    assert hits.returncode != 0 and "not served" in hits.stderr
    assert "Traceback" not in hits.stderr
    b2.proc.send_signal(signal.SIGTERM)
    b2.proc.communicate(timeout=60)


def test_a_torn_flush_is_cut_by_check_fix(broker, tmp_path):
    b = broker()
    path = tmp_path / "in.jsonl"
    write_texts(path, 100, seed=3)
    assert submit(b.config, path, "--job-id", "j2", "--deliver", "vectors:docs").returncode == 0
    wait_for(lambda: delivered(b, "j2"), "the job to be delivered", timeout_s=60)
    assert b.stop() == exitcodes.OK
    payload, _ids, journal = shard_paths(b.data_dir.root / "vectors" / "docs", 0)
    with open(payload, "ab") as f:  # a crash mid-flush: bytes written, never journalled
        f.write(b"\x01" * 1000)
    with open(journal, "ab") as f:
        f.write(b"\x10\x00\x00")
    check = cli(b.config, "check")
    assert check.returncode != 0
    assert "vector-unacknowledged-rows" in check.stdout and "vector-torn-journal" in check.stdout
    fixed = cli(b.config, "check", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert_check_clean(b.data_dir)
