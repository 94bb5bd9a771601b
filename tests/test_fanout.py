"""Fan-out and join: one request line, several parts (items), one response line.

docs/input-format.md ("Lines with several parts") and docs/completion.md
("Lines and parts"). The parsing tests run in process; the pipeline tests
run a real broker (tests/broker.py) and validate every output body with the
openai package's own types.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai.types
import orjson
import pytest
from broker import REPO, TEXT_LIMIT_TOKENS, WORDS, Broker, submit, write_config
from conftest import assert_check_clean, wait_for
from smollm2 import needs_model
from test_dispatch_pipeline import assert_each_once, cli, fetch, finished, job_info

from collector.results_client import ResultsClient
from config import load_settings
from ingest.batch_input import iter_batch_input
from ingest.catalog import ModelCatalog
from ingest.chunk_check import recheck
from ingest.custom_ids import CustomIdSet
from pipeline.core.errors import FabricError
from pipeline.core.item_seq import PART_BASE
from pipeline.store.intern_table import InternTable
from pipeline.store.job_files import JobFiles, acknowledged_indexes

GEN_MODEL = """
[[models]]
name = "gen"
engine = "echo"
endpoints = ["/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/responses"]
tokenizer = "{tokenizer}"
max_tokens = 64
"""


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def embed(custom_id: str, model: str = "gen", **body) -> dict:
    return line(custom_id, "/v1/embeddings", model=model, **body)


def write(path: Path, lines: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def config(tmp_path: Path, workers: int = 1, **kw) -> Path:
    """tests/broker.py's config and a model `gen` (echo engine, text and token ids, every
    endpoint) that the local workers serve."""
    path = write_config(tmp_path, workers=workers, worker_keys='model = "gen"', **kw)
    tokenizer = tmp_path / "tokenizer.json"
    path.write_text(path.read_text() + GEN_MODEL.format(tokenizer=tokenizer))
    return path


# ---- parsing ---------------------------------------------------------------------------


def test_list_lines_become_one_item_per_part_with_part_region_indexes(tmp_path):
    settings = load_settings(config(tmp_path))
    lines = [
        embed("one", input="a b"),
        embed("three", input=["a", "b c", "d"]),
        embed("ids", input=[5, 6, 7]),
        embed("lists", input=[[1, 2], [3]]),
        line("gen", "/v1/completions", model="gen", prompt=["a", "b"], n=2, seed=7),
    ]
    [chunk] = list(iter_batch_input(write(tmp_path / "in.jsonl", lines), settings))
    assert not chunk.errors
    assert chunk.line.tolist() == [1, 2, 2, 2, 3, 4, 4, 5, 5, 5, 5]
    base = PART_BASE
    assert chunk.indexes.tolist() == [
        0,
        1,
        base,
        base + 1,
        2,
        3,
        base + 2,
        4,
        *range(base + 3, base + 6),
    ]
    assert chunk.fanout == ((2, 3, base, 1), (4, 2, base + 2, 1), (5, 4, base + 3, 2))
    assert [chunk.texts[i] for i in range(4)] == ["a b", "a", "b c", "d"]
    seeds = [chunk.shapes[s].seed for s in chunk.shape_index[-4:].tolist()]
    assert seeds == [7, 8, 7, 8]  # part p = prompt i * n + sample j, sample j has seed + j


def test_a_line_with_one_bad_part_is_one_error_and_drops_every_part(tmp_path):
    settings = load_settings(config(tmp_path))
    too_long = " ".join(WORDS[0] for _ in range(TEXT_LIMIT_TOKENS + 1))
    lines = [
        embed("bad-part", input=[[1], []]),
        embed("ok", input=["a", "b"]),
        embed("many", input=["a"] * 2049),
        embed("long", input=["a", too_long]),
    ]
    from ingest.tokenize import load_tokenizers, tokenize_chunk

    [chunk] = list(iter_batch_input(write(tmp_path / "in.jsonl", lines), settings))
    chunk = tokenize_chunk(chunk, load_tokenizers(settings), settings)
    assert [(e.line, e.code) for e in chunk.errors] == [
        (1, "empty_prompt"),
        (3, "too_many_inputs"),
        (4, "prompt_too_long"),
    ]
    assert "body.input[1] is empty" in chunk.errors[0].message
    assert chunk.custom_ids == ("ok", "ok")


def test_the_per_line_token_budget_is_a_per_line_error(tmp_path):
    path = config(tmp_path)
    path.write_text(
        path.read_text().replace("chunk_items = 200", "chunk_items = 200\nmax_line_tokens = 5")
    )
    settings = load_settings(path)
    lines = [
        embed("ids", input=[[1, 2, 3], [4, 5, 6]]),
        embed("text", input=["a b c", "d e f"]),
        embed("fits", input=["a b", "c"]),
    ]
    from ingest.tokenize import load_tokenizers, tokenize_chunk

    [chunk] = list(iter_batch_input(write(tmp_path / "in.jsonl", lines), settings))
    chunk = tokenize_chunk(chunk, load_tokenizers(settings), settings)
    assert [(e.line, e.code) for e in chunk.errors] == [
        (1, "line_too_many_tokens"),
        (2, "line_too_many_tokens"),
    ]
    assert "6 tokens together" in chunk.errors[0].message
    assert chunk.custom_ids == ("fits", "fits")


# ---- through a real broker -------------------------------------------------------------


@pytest.fixture
def broker(tmp_path):
    started: list[Broker] = []

    def start(chunk_items: int = 200, **kw) -> Broker:
        path = config(tmp_path, **kw)
        text = path.read_text().replace("chunk_items = 200", f"chunk_items = {chunk_items}")
        path.write_text(text)
        b = Broker(path).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


def outputs(out: Path) -> dict[str, dict]:
    records = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    return {record["custom_id"]: record for record in records}


def errors(out: Path) -> dict[str, dict]:
    path = Path(f"{out}.errors.jsonl")
    records = [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []
    return {record["custom_id"]: record for record in records}


def run_job(b: Broker, tmp_path: Path, job: str, lines: list[dict], timeout_s: float = 120):
    data = write(tmp_path / f"{job}.jsonl", lines)
    result = submit(b.config, data, "--job-id", job)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: finished(b, job), f"job {job} to finish", timeout_s=timeout_s)
    out = tmp_path / f"{job}.out.jsonl"
    result = fetch(b, job, out)
    assert result.returncode == 0, result.stderr
    return out


def test_every_fan_out_row_through_a_broker_in_openais_shape(tmp_path, broker):
    b = broker(workers=1)
    texts = ["alpha beta", "gamma", "delta epsilon zeta"]
    lines = [
        embed("strings", input=texts),
        embed("ids", input=[5, 6, 7]),
        embed("id-lists", input=[[1, 2], [3], [4, 5, 6]]),
        embed("single", input=[9]),
        line("prompts", "/v1/completions", model="gen", prompt=["a b", "c"], max_tokens=8),
        line("n-seeded", "/v1/completions", model="gen", prompt="d e", n=4, seed=3, max_tokens=8),
        line(
            "chat-n",
            "/v1/chat/completions",
            model="gen",
            messages=[{"role": "user", "content": "f g"}],
            n=2,
            max_tokens=8,
        ),
        embed("too-many", input=["a"] * 2049),
        embed("bad-part", input=[[1], [2**40]]),
    ]
    out = run_job(b, tmp_path, "fan", lines)
    assert_each_once(out, len(lines))
    got, failed = outputs(out), errors(out)
    assert set(failed) == {"too-many", "bad-part"}
    assert failed["too-many"]["error"]["code"] == "too_many_inputs"
    assert "body.input[1][0]" in failed["bad-part"]["error"]["message"]

    def body(custom_id):
        return got[custom_id]["response"]["body"]

    strings = openai.types.CreateEmbeddingResponse.model_validate(body("strings"))
    assert [d.index for d in strings.data] == [0, 1, 2]
    lengths = [len(t.split()) for t in texts]  # echo: the padded token ids as floats
    assert strings.usage.prompt_tokens == sum(lengths)
    one = openai.types.CreateEmbeddingResponse.model_validate(body("ids"))
    assert len(one.data) == 1 and one.data[0].embedding[:3] == [5.0, 6.0, 7.0]
    lists = openai.types.CreateEmbeddingResponse.model_validate(body("id-lists"))
    want = [[1, 2], [3], [4, 5, 6]]
    got_ids = [d.embedding[: len(ids)] for d, ids in zip(lists.data, want, strict=True)]
    assert got_ids == [[float(t) for t in ids] for ids in want]
    prompts = openai.types.Completion.model_validate(body("prompts"))
    assert [c.index for c in prompts.choices] == [0, 1]
    assert [c.model_extra["token_ids"] for c in prompts.choices][1] != []
    seeded = openai.types.Completion.model_validate(body("n-seeded"))
    assert [c.index for c in seeded.choices] == [0, 1, 2, 3]
    chat = openai.types.chat.ChatCompletion.model_validate(body("chat-n"))
    assert [c.index for c in chat.choices] == [0, 1]
    info = job_info(b, "fan")
    assert (info["total"], info["completed"], info["failed"]) == (9, 7, 2)
    assert info["fanout"] == {"lines": 5, "parts": 3 + 3 + 2 + 4 + 2}
    table = InternTable(b.data_dir.root)
    seeds = {table._by_id[k].get("seed") for k in table._by_id}
    assert seeds >= {3, 4, 5, 6}  # n = 4 with seed 3: samples drawn with seeds 3..6
    assert b.stop() == 0, b.stderr
    assert_check_clean(b.data_dir)


def test_journal_maps_parts_to_lines(tmp_path, broker):
    b = broker(workers=1)
    lines = [embed(f"e{i}", input=["a", "b c"][: 1 + i % 2]) for i in range(6)]
    run_job(b, tmp_path, "map", lines)
    index = acknowledged_indexes(JobFiles(b.data_dir.root).journal_path("map"))
    assert index.tolist() == [0, 1, 2, 3, 4, 5, PART_BASE, PART_BASE + 1, PART_BASE + 2]
    assert np.all(index >= 0)
    assert b.stop() == 0, b.stderr
    assert_check_clean(b.data_dir)


def _completed(b: Broker, job: str) -> int:
    """Lines of `job` done, 0 while the broker does not know the job yet."""
    result = cli(b, "status", job, "--json", timeout_s=60)
    return json.loads(result.stdout)["completed"] if result.returncode == 0 else 0


def _lines_done(results: ResultsClient, job: str) -> int:
    """Lines of `job` done, 0 while the broker does not know the job yet."""
    try:
        return int(results.job_status(job)["completed"])
    except FabricError:
        return 0


def _strings(line: int, parts: int) -> list[str]:
    """Two words per part, unique over the whole job: w<a % 1000> w<a // 1000>."""
    return [f"w{(line * parts + p) % 1000} w{(line * parts + p) // 1000}" for p in range(parts)]


@pytest.mark.slow
def test_a_64000_item_list_job_survives_a_broker_kill_with_each_line_once_and_whole(
    tmp_path, broker
):
    """1,000 lines of 64 strings (the size issue 18 names): kill -9 of the whole broker
    mid-run and start it again; the submit goes on with the new broker: every line once,
    whole, its 64 parts in input order, none computed into another line (the echo engine
    embeds a part as its own token ids)."""
    from tokenizers import Tokenizer

    lines_n, parts = 1000, 64
    b = broker(workers=1, chunk_items=50)  # chunks of 3,200 items
    lines = [embed(f"l{i}", input=_strings(i, parts)) for i in range(lines_n)]
    data = write(tmp_path / "big.jsonl", lines)
    cmd = [sys.executable, "run.py", "submit", str(data), "--job-id", "big", "--chunk-lines", "50"]
    # an answer timeout longer than the test: a chunk lost with the killed broker must be sent
    # again as soon as the producer is connected to the new one (pipeline/transport/reconnect_watch.py)
    cmd += ["--timeout", "900"]
    cmd.append("--config")  # --chunk-lines: submit would size chunks by parts (64 items each)
    producer = subprocess.Popen(
        [*cmd, str(b.config)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        # asked in-process (a status command costs a new interpreter per poll): the kill comes
        # as soon as the first lines are done, long before the last
        with ResultsClient(b.settings.completion.bind, timeout_s=10) as results:
            wait_for(lambda: _lines_done(results, "big") > 0, "some lines done", 240)
            before = _lines_done(results, "big")
        b.kill()  # the whole broker: supervisor and every stage
        assert before < lines_n, "the job was done before the kill: nothing was tested"
        b.start()
        restarted = time.monotonic()
        _, err = producer.communicate(timeout=300)  # it goes on with the new broker life
        resumed_s = time.monotonic() - restarted
    finally:
        if producer.poll() is None:  # a failed test leaves no producer running
            producer.kill()
            producer.communicate()
    assert producer.returncode == 0, err.decode()
    assert resumed_s < 300  # liveness: far under the producer's 900 s answer timeout
    started = time.monotonic()
    wait_for(lambda: finished(b, "big"), "the job to finish after the restart", timeout_s=600)
    took = time.monotonic() - started
    info = job_info(b, "big")
    assert (info["total"], info["completed"], info["failed"]) == (lines_n, lines_n, 0)
    assert info["fanout"] == {"lines": lines_n, "parts": lines_n * parts}
    out = tmp_path / "big.out.jsonl"
    assert fetch(b, "big", out, timeout_s=600).returncode == 0
    assert_each_once(out, lines_n)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for custom_id, record in outputs(out).items():
        body = openai.types.CreateEmbeddingResponse.model_validate(record["response"]["body"])
        assert [d.index for d in body.data] == list(range(parts))
        want = [e.ids for e in tokenizer.encode_batch(_strings(int(custom_id[1:]), parts))]
        got = [d.embedding[: len(ids)] for d, ids in zip(body.data, want, strict=True)]
        assert got == [[float(t) for t in ids] for ids in want], custom_id
    assert took < 600  # liveness: bounded by the wait above
    assert b.stop() == 0, b.stderr
    assert_check_clean(b.data_dir)


@needs_model
@pytest.mark.slow
@pytest.mark.timeout(300)  # the first model test of a session saves SmolLM2 (tests/smollm2.py)
def test_n_samples_of_smollm2_are_distinct_without_a_seed_and_repeat_with_one(
    tmp_path, smol_broker
):
    """The transformers engine samples each item with its shape's seed (a random one without):
    n = 4 without a seed gives four distinct samples; with a seed, seeds + j, the same four
    again on a rerun."""
    b = smol_broker  # stopped, and its data dir checked, at the end of the session
    sampled = {"temperature": 1.0, "max_tokens": 12, "n": 4}
    lines = [
        line("free", "/v1/completions", model="smol", prompt="Once upon a time", **sampled),
        line("seeded", "/v1/completions", model="smol", prompt="The sea", seed=5, **sampled),
    ]
    first = outputs(run_job(b, tmp_path, "s1", lines, timeout_s=300))
    second = outputs(run_job(b, tmp_path, "s2", lines[1:], timeout_s=300))

    def samples(record):
        body = openai.types.Completion.model_validate(record["response"]["body"])
        assert [c.index for c in body.choices] == [0, 1, 2, 3]
        return [tuple(c.model_extra["token_ids"]) for c in body.choices]

    assert len(set(samples(first["free"]))) == 4  # four distinct samples without a seed
    seeded = samples(first["seeded"])
    assert len(set(seeded)) == 4  # seeds 5, 6, 7, 8: four different draws
    assert samples(second["seeded"]) == seeded  # and the same four on a rerun


def test_the_front_checks_a_fan_out_chunk_again_per_line(tmp_path):
    """Nothing from the network is trusted: the front's recheck applies the per-line limits,
    keeps a line's parts (which share its custom_id) from looking like duplicates, and on a
    retry sends only the parts of a line an earlier attempt did not store."""
    settings = load_settings(config(tmp_path))
    lines = [
        embed("ok", input=[[1, 2], [3]]),
        embed("wide", input=[[1], [2], [3]]),
        embed("heavy", input=[[1, 2, 3], [4, 5]]),
        embed("plain", input=[7]),
    ]
    [chunk] = list(iter_batch_input(write(tmp_path / "in.jsonl", lines), settings))
    strict = replace(ModelCatalog.from_settings(settings), max_parts=2, max_line_tokens=4)
    checked = recheck(chunk, strict, CustomIdSet(), [], None)
    got = [(e.line, e.code) for e in checked.chunk.errors]
    assert got == [(2, "too_many_inputs"), (3, "line_too_many_tokens")]
    assert checked.chunk.custom_ids == ("ok", "ok", "plain")
    assert len(checked.digests[0]) == 2  # one custom_id per line
    stored = np.array([0, PART_BASE + 3])  # line 1's part 0 and line 3's part 1, say
    again = recheck(chunk, ModelCatalog.from_settings(settings), CustomIdSet(), [], stored)
    assert again.chunk.indexes.tolist() == [PART_BASE, 1, PART_BASE + 1, PART_BASE + 2, 2, 3]
    assert again.already == [(1, "ok"), (3, "heavy")]


def test_completion_counts_lines_and_pages_carry_whole_lines_even_half_marked(data_dir):
    """Lines of 3 parts: a line counts done only with every part; a page never holds part of
    a line; a page is cut to about its limit in whole lines; and a line whose parts were
    marked delivered only in part (a crash between segments) still comes whole."""
    from collector.completion.results_log import CompletionLog
    from pipeline.core.line_table import LineTable

    table = LineTable()
    table.add([[1, 3, PART_BASE], [2, 3, PART_BASE + 2], [3, 3, PART_BASE + 4]])
    log = CompletionLog(data_dir, lambda s: None, line_table=lambda job: table)

    def store(*index):
        n = log.record_errors("j", 1, np.array(index), [f"e: part {i}" for i in index])
        log.sync_outputs()
        return n

    store(0, PART_BASE, 1)  # two parts of line 1, one of line 2: no line done
    assert (log.completed("j"), log.failed("j")) == (0, 0)
    assert len(log.page("j", 100)) == 0
    store(PART_BASE + 1)  # line 1's last part: now whole, line 2 still waits
    assert (log.completed("j"), log.failed("j")) == (1, 1)
    page = log.page("j", 100)
    assert page.index.tolist() == [0, 0, 0] and sorted(page.part.tolist()) == [0, 1, 2]
    store(PART_BASE + 2, PART_BASE + 3, 2, PART_BASE + 4, PART_BASE + 5)
    assert (log.completed("j"), log.failed("j")) == (3, 3)
    page = log.page("j", 3)  # its 3 rows touch lines 1 and 2: cut to whole lines, 3 rows
    assert page.index.tolist() == [0, 0, 0]
    half = [(s, slots[:1]) for s, slots in page.where]  # a crash after marking one slot
    log.delivered("j", half)
    again = log.page("j", 100)
    assert len(again) == 9  # every line whole, the half-marked one included
    assert sorted(zip(again.index.tolist(), again.part.tolist(), strict=True)) == [
        (line, part) for line in range(3) for part in range(3)
    ]
    log.delivered("j", again.where)
    assert len(log.page("j", 100)) == 0 and log.undelivered("j") == 0
