"""Embeddings lines with an `input` list delivered to the vector store: one vector per input.

A line of k inputs is k parts (docs/completion.md, "Lines and parts"); each
lands in the store as its own vector, its id its part's item seq, and
`run.py vectors` names it by custom_id and part (collector/vectors/sink.py).
Through a real broker with the simulated engine, as tests/test_vector_delivery.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import test_vector_delivery
from broker import WORDS, Broker, submit
from conftest import assert_check_clean, wait_for
from test_vector_delivery import SIM_WORKER, cli, delivered, store_rows

from pipeline.core import exitcodes
from pipeline.core.item_seq import PART_BASE, index_of, job_of

broker = test_vector_delivery.broker  # the fixture: a broker with a `sim` worker


def write_lists(
    path: Path, lines: int, parts: int, seed: int, words: tuple[int, int] = (3, 12)
) -> list[list[str]]:
    """`lines` embeddings lines for `sim`, custom_id l{i}, each an `input` list of `parts`
    texts; returns the texts."""
    rng = np.random.default_rng(seed)
    texts = [
        [" ".join(rng.choice(WORDS, int(rng.integers(*words)))) for _ in range(parts)]
        for _ in range(lines)
    ]
    with open(path, "w") as out:
        for i, inputs in enumerate(texts):
            body = {"model": "sim", "input": inputs}
            line = {"custom_id": f"l{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(json.dumps(line) + "\n")
    return texts


def exported(b: Broker, store: str) -> tuple[list[dict], np.ndarray]:
    out = b.config.parent / f"{store}.npy"
    done = cli(b.config, "vectors", "export", "--store", store, "-o", str(out))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(x) for x in Path(f"{out}.ids.jsonl").read_text().splitlines()]
    matrix = np.load(out)
    assert len(rows) == len(matrix)
    return rows, matrix


def error_lines(b: Broker, job: str) -> list[str]:
    path = b.data_dir.root / "vectors" / "errors" / f"{job}.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_each_input_of_a_list_line_is_its_own_vector_named_by_custom_id_and_part(broker, tmp_path):
    b = broker()
    texts = write_lists(tmp_path / "lists.jsonl", 20, 4, seed=3)
    singles = tmp_path / "singles.jsonl"
    with open(singles, "w") as out:  # the same texts, one line each
        for i, inputs in enumerate(texts):
            for p, text in enumerate(inputs):
                body = {"model": "sim", "input": text}
                line = {"custom_id": f"s{i}-{p}", "method": "POST", "url": "/v1/embeddings"}
                out.write(json.dumps({**line, "body": body}) + "\n")
    for job, path in (("lists", tmp_path / "lists.jsonl"), ("singles", singles)):
        done = submit(b.config, path, "--job-id", job, "--deliver", "vectors:docs")
        assert done.returncode == 0, done.stderr
        wait_for(lambda job=job: delivered(b, job), f"job {job} delivered", timeout_s=90)
    assert error_lines(b, "lists") == []
    rows, matrix = exported(b, "docs")
    assert len(rows) == 2 * 80
    by_name = {(r["job"], r["custom_id"], r["part"]): i for i, r in enumerate(rows)}
    assert len(by_name) == len(rows)  # each (custom_id, part) once
    for i, inputs in enumerate(texts):
        for p in range(len(inputs)):
            listed = matrix[by_name[("lists", f"l{i}", p)]]
            alone = matrix[by_name[("singles", f"s{i}-{p}", 0)]]
            assert np.array_equal(listed, alone), (i, p)  # part p is input[p], in order
    ids = np.array([r["id"] for r in rows if r["job"] == "lists"], np.uint64)
    assert len(set(ids.tolist())) == len(ids) and len(set(job_of(ids).tolist())) == 1
    parts = np.array([r["part"] for r in rows if r["job"] == "lists"])
    assert ((index_of(ids) >= PART_BASE) == (parts > 0)).all()  # part 0 at its line's index

    hits = cli(
        b.config,
        "vectors",
        "search",
        "--store",
        "docs",
        "--text",
        texts[7][2],
        "-k",
        "4",
        "--json",
    )
    assert hits.returncode == 0, hits.stderr
    top = [json.loads(x) for x in hits.stdout.splitlines()]
    named = {(h["job"], h["custom_id"], h["part"]) for h in top if h["score"] > 0.9999}
    assert ("lists", "l7", 2) in named and ("singles", "s7-2", 0) in named
    assert {h["text"] for h in top if h["custom_id"] in ("l7", "s7-2")} == {texts[7][2]}
    assert b.stop() == exitcodes.OK
    assert_check_clean(b.data_dir)


@pytest.mark.timeout(240)
def test_sigkill_of_the_vector_stage_and_the_broker_stores_each_part_once(broker, tmp_path):
    # a worker slow enough (300 tokens a second, about 4 s per 100 rows) that delivery cannot
    # outrun the kills, however slowly the machine lets this test poll the store; the broker
    # is restarted after the last kill with a fast worker, so the rest takes no time
    slow = SIM_WORKER.replace("simulated_tokens_per_s = 5e6", "simulated_tokens_per_s = 3e2")
    b = broker("flush_ms = 50.0\npage_items = 64", worker_keys=slow)
    path = tmp_path / "in.jsonl"
    lines, parts = 150, 8
    write_lists(path, lines, parts, seed=1, words=(8, 17))
    done = submit(b.config, path, "--job-id", "kills", "--deliver", "vectors")
    assert done.returncode == 0, done.stderr
    restarted = []  # the broker fixture closes only the first life
    try:
        seen = []
        for kills, target in enumerate((60, 160, 260)):  # mid-delivery, each further along
            wait_for(
                lambda t=target, b=b: store_rows(b.config, "sim") >= t or delivered(b, "kills"),
                f"{target} rows stored",
                timeout_s=60,
            )
            seen.append((target, store_rows(b.config, "sim"), delivered(b, "kills")))
            assert not delivered(b, "kills"), f"delivered before kill {kills + 1}: {seen}"
            if kills < 2:
                b.kill_stage("vectors-0")
            else:  # the whole broker last (its restart is slow), then the rest at full speed
                b.kill()
                b.config.write_text(b.config.read_text().replace(slow, SIM_WORKER))
                b = Broker(b.config).start()
                restarted.append(b)
        wait_for(lambda: delivered(b, "kills"), "the job to be delivered", timeout_s=120)
        assert error_lines(b, "kills") == []
        rows, _ = exported(b, "sim")
        named = [(r["custom_id"], r["part"]) for r in rows if r["job"] == "kills"]
        assert len(named) == len(set(named)) == lines * parts  # none lost, none doubled
        assert set(named) == {(f"l{i}", p) for i in range(lines) for p in range(parts)}
        assert b.stop() == exitcodes.OK
    finally:
        for life in restarted:
            life.close()
    assert_check_clean(b.data_dir)
