"""The vector sink one page at a time: what it appends, refuses, skips and acknowledges."""

from __future__ import annotations

import json
import logging
import tracemalloc

import numpy as np
import pytest

from collector.vectors.sink import VectorSink
from collector.vectors.store_catalog import StoreSet
from pipeline.core.item_seq import PART_BASE
from pipeline.core.result_kinds import ResultKind
from pipeline.store.job_files import JobFiles

DIM = 8
LOG = logging.getLogger("test")


def make_job(root, job_id: str, job_no: int, deliver: str) -> None:
    JobFiles(root).write_record(
        job_id,
        {
            "job_id": job_id,
            "job_no": job_no,
            "created_ns": 1,
            "chunk_lines": 10,
            "deliver": deliver,
        },
    )


def page(index, vectors=None, status=None, kind=None, payloads=None, page_id=1, req=1, **meta):
    """A RESULT_PAGE as completion sends it: embeddings (f32 rows) unless payloads are given."""
    index = np.asarray(index, np.int64)
    n = len(index)
    if payloads is None:
        payloads = [np.asarray(v, "<f4").tobytes() for v in vectors]
    sizes = [len(p) for p in payloads]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    arrays = {
        "index": index,
        "status": np.zeros(n, np.uint8) if status is None else np.asarray(status, np.uint8),
        "kind": np.full(n, ResultKind.VECTOR, np.uint8)
        if kind is None
        else np.asarray(kind, np.uint8),
        "model": np.zeros(n, np.uint16),
        "shape": np.zeros(n, np.uint16),
        "prompt_tokens": np.zeros(n, np.uint32),
        "payload": np.frombuffer(b"".join(payloads), np.uint8),
        "offsets": offsets,
    }
    info = {
        "job": "j",
        "page": page_id,
        "req": req,
        "state": "in_progress",
        "undelivered": n,
        "custom_ids": [f"c{i}" for i in index.tolist()],
        "models": {"0": "sim"},
        **meta,
    }
    return info, arrays


@pytest.fixture
def sink(tmp_path):
    make_job(tmp_path, "j", 7, "vectors:docs")
    make_job(tmp_path, "other", 8, "file")
    stores = StoreSet(tmp_path / "vectors", "float32", 1 << 20)
    s = VectorSink(stores, JobFiles(tmp_path), 100, LOG)
    yield s
    stores.close()


def fetch(sink, now=0.0):
    (meta,) = sink.due(now)
    return meta


def test_only_vectors_jobs_are_fetched_and_an_ack_waits_for_the_flush(sink):
    assert set(sink.jobs) == {"j"}
    meta = fetch(sink)
    assert meta["ack"] == 0 and meta["sink"] == "vectors" and meta["job"] == "j"
    assert sink.due(1.0) == []  # one FETCH in flight per job
    rng = np.random.default_rng(0)
    sink.on_page(*page([0, 1, 2], rng.standard_normal((3, DIM)), page_id=5, req=meta["req"]), 1.0)
    _, store = sink.stores.get("docs")
    assert store.pending_rows == 3 and store.rows == 0
    assert sink.due(2.0) == []  # nothing until the rows are durable
    sink.stores.flush()
    sink.flushed(2.0)
    meta = fetch(sink, 2.0)
    assert meta["ack"] == 5
    ids, _ = store.read(0, 0, 3)
    assert (np.asarray(ids) >> np.uint64(32) == 7).all()
    assert (np.asarray(ids) & np.uint64(0xFFFFFFFF)).tolist() == [0, 1, 2]


def test_a_page_sent_again_is_not_stored_twice_even_after_a_restart(sink, tmp_path):
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((4, DIM))
    meta = fetch(sink)
    sink.on_page(*page([0, 1, 2, 3], vectors, page_id=1, req=meta["req"]), 0.0)
    sink.stores.flush()
    sink.flushed(0.0)
    # The sink restarts before completion saw the ack: the same results come again.
    sink.stores.close()
    stores = StoreSet(tmp_path / "vectors", "float32", 1 << 20)
    again = VectorSink(stores, JobFiles(tmp_path), 100, LOG)
    meta = fetch(again)
    again.on_page(
        *page([2, 3, 4], np.vstack([vectors[2:], vectors[:1]]), page_id=1, req=meta["req"]), 0.0
    )
    _, store = stores.get("docs")
    assert store.pending_rows == 1  # only item 4 is new
    assert again.jobs["j"].skipped == 2
    stores.close()


def test_errors_and_what_the_store_cannot_take_become_error_lines(sink, tmp_path):
    rng = np.random.default_rng(2)
    good = rng.standard_normal((2, DIM)).astype("<f4")
    nan = good[0].copy()
    nan[3] = np.nan
    payloads = [
        good[0].tobytes(),
        b"engine_error: the GPU fell over",
        np.arange(4, dtype="<u4").tobytes(),  # tokens, not an embedding
        good[1].tobytes(),
        nan.tobytes(),
        np.zeros(DIM + 1, "<f4").tobytes(),  # another dim than the store's
    ]
    status = [0, 1, 0, 0, 0, 0]
    kind = [ResultKind.VECTOR, ResultKind.TEXT, ResultKind.TOKENS] + [ResultKind.VECTOR] * 3
    meta = fetch(sink)
    sink.on_page(*page(range(6), payloads=payloads, status=status, kind=kind, req=meta["req"]), 0.0)
    _, store = sink.stores.get("docs")
    assert store.pending_rows == 2
    lines = [json.loads(x) for x in (tmp_path / "vectors/errors/j.jsonl").read_text().splitlines()]
    by_id = {line["custom_id"]: line["error"] for line in lines}
    assert set(by_id) == {"c1", "c2", "c4", "c5"}
    assert by_id["c1"]["code"] == "engine_error"
    assert "not an embedding" in by_id["c2"]["message"]
    assert "NaN" in by_id["c4"]["message"]
    assert "dim 8" in by_id["c5"]["message"]


def test_a_stale_answer_is_dropped_and_a_finished_job_is_marked(sink, tmp_path):
    meta = fetch(sink)
    sink.on_page(*page([0], np.ones((1, DIM)), req=meta["req"] - 1), 0.0)  # an older request
    assert "docs" not in sink.stores.open
    sink.on_page(*page([], [], req=meta["req"], state="completed", undelivered=0), 0.0)
    assert "j" not in sink.jobs
    assert (tmp_path / "vectors/delivered/j").exists()
    assert sink.delivered_jobs == 1


def test_a_page_of_only_errors_is_acknowledged_without_a_flush(sink):
    meta = fetch(sink)
    info, arrays = page(
        [0], payloads=[b"bad: no"], status=[1], kind=[ResultKind.TEXT], page_id=9, req=meta["req"]
    )
    sink.on_page(info, arrays, 0.0)
    assert fetch(sink, 0.0)["ack"] == 9


def test_a_rotation_that_fails_midway_stores_each_row_once_after_the_retry(tmp_path, monkeypatch):
    from collector.vectors import vector_store as store_module
    from pipeline.core.errors import DiskFullError

    make_job(tmp_path, "j", 7, "vectors:docs")
    stores = StoreSet(tmp_path / "vectors", "float32", 4 * DIM * 4)  # 4 rows a shard
    sink = VectorSink(stores, JobFiles(tmp_path), 100, LOG)
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((6, DIM))
    real_create = store_module.Shard.create
    calls = []

    def create(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:  # the rotation to shard 1
            raise DiskFullError("no space left on device (test)")
        return real_create(*args, **kwargs)

    monkeypatch.setattr(store_module.Shard, "create", create)
    meta = fetch(sink)
    sink.on_page(*page(range(6), vectors, page_id=3, req=meta["req"]), 0.0)
    _, store = stores.get("docs")
    assert store.rows == 4  # the first shard was sealed (flushed) by the rotation
    assert sink.jobs["j"].delivery.ack == 0  # nothing acknowledged
    meta = fetch(sink, 100.0)  # asked again later, without an ack
    assert meta["ack"] == 0
    sink.on_page(*page(range(6), vectors, page_id=4, req=meta["req"]), 100.0)
    stores.flush()
    ids = np.concatenate([np.asarray(i) for i in store.ids()]) & np.uint64(0xFFFFFFFF)
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4, 5]
    stores.close()


def test_a_fan_out_page_keeps_its_parts_in_a_small_set_and_skips_them_when_sent_again(
    sink, tmp_path
):
    """A part's item index is PART_BASE and up (pipeline/core/item_seq.py): the set of stored items
    holds it at index - PART_BASE, not as bit 2**31 of one bitmap (2 GiB, grown and copied
    while the stage answers nobody)."""
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((3, DIM))
    parts = {"item": np.array([0, PART_BASE, PART_BASE + 1]), "part": np.array([0, 1, 2])}
    meta = fetch(sink)
    info, arrays = page([0, 0, 0], vectors, page_id=1, req=meta["req"])
    tracemalloc.start()  # numpy's buffers are traced too
    try:
        sink.on_page(info, {**arrays, **parts}, 0.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes for one page of 3 rows"
    have = sink.jobs["j"].have
    assert have.count() == 3 and have.has(parts["item"]).all()
    sink.stores.flush()
    sink.flushed(0.0)
    sink.stores.close()
    stores = StoreSet(tmp_path / "vectors", "float32", 1 << 20)  # a restart: rebuilt from the ids
    again = VectorSink(stores, JobFiles(tmp_path), 100, LOG)
    meta = fetch(again)
    info, arrays = page([0, 0, 0], vectors, page_id=1, req=meta["req"])
    again.on_page(info, {**arrays, **parts}, 0.0)
    _, store = stores.get("docs")
    assert store.pending_rows == 0 and again.jobs["j"].skipped == 3
    stores.close()
