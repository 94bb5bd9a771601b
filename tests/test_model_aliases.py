"""Models under Hugging Face ids with OpenAI aliases, through a real broker and every door.

One broker serves `meta-llama/Llama-3.1-8B-Instruct` (echo engine, chat and
text completions), which also answers to `gpt-4o-mini` and `llama:8b`, and
`intfloat/e5-mistral-7b-instruct` (simulated embeddings), which also answers
to `text-embedding-3-small`, each with a local worker. A file written for
OpenAI goes through `run.py submit` + `results`, through the HTTP API with the
official openai client, and into a vector store; `run.py batch --alias` runs
one on a private broker. Each output line's `model` is the name its request
gave; files on disk know each model by its own name, its '/' encoded, never a
directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import zygote
from broker import REPO, WORDS, Broker, free_port, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from test_dispatch_pipeline import fetch, job_info
from test_oneshot import batch

from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError
from pipeline.core.file_names import file_safe, from_file_safe
from pipeline.store.job_files import JobFiles, journal_records
from pipeline.store.segment import Segment
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, segment_file_name

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
E5 = "intfloat/e5-mistral-7b-instruct"
CHAT_NAMES = (LLAMA, "gpt-4o-mini", "llama:8b")
EMBED_NAMES = (E5, "text-embedding-3-small")
CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"


def models_toml(tokenizer: Path) -> str:
    return f"""
[[models]]
name = "{LLAMA}"
engine = "echo"
endpoints = ["{CHAT}", "/v1/completions"]
aliases = ["gpt-4o-mini", "llama:8b"]
[[models]]
name = "{E5}"
engine = "simulated"
endpoints = ["{EMBED}"]
tokenizer = "{tokenizer}"
max_tokens = 64
aliases = ["text-embedding-3-small"]
"""


WORKERS = f"""[[workers]]
model = "{LLAMA}"
[[workers]]
model = "{E5}"
simulated_tokens_per_s = 5e6
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(broker, openai client) of a broker serving LLAMA and E5 under their aliases too."""
    tmp_path = tmp_path_factory.mktemp("aliases")
    port = free_port()
    config = write_config(tmp_path, extra=f'[api]\nenabled = true\nbind = "127.0.0.1:{port}"\n')
    text = config.read_text().replace("[workers]\nlocal = 0\n", WORKERS)
    config.write_text(text + models_toml(tmp_path / "tokenizer.json"))
    b = Broker(config, stderr_path=tmp_path / "broker.err")
    try:
        b.start()
        yield b, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)  # segment files named after LLAMA and E5 check clean
    finally:
        b.close()


def request(i: int, model: str) -> dict:
    """Line i: a chat request of token ids, or an embedding of text for an embedding name."""
    if model in EMBED_NAMES:
        body = {"model": model, "input": " ".join(WORDS[i % 200 : i % 200 + 3 + i % 9])}
        return {"custom_id": f"c{i}", "method": "POST", "url": EMBED, "body": body}
    body = {"model": model, "prompt_token_ids": [1 + i % 90, 2, 3], "max_tokens": 3}
    return {"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body}


def write_requests(path: Path, names: list[str]) -> dict[str, str]:
    """One line per entry of `names`, naming that model; custom_id -> the name it gave."""
    with open(path, "w") as out:
        for i, name in enumerate(names):
            out.write(json.dumps(request(i, name)) + "\n")
    return {f"c{i}": name for i, name in enumerate(names)}


def outputs(path: Path) -> dict[str, dict]:
    """custom_id -> response body, each custom_id once."""
    bodies: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["custom_id"] not in bodies, record["custom_id"]
        bodies[record["custom_id"]] = record["response"]["body"]
    return bodies


def test_a_file_naming_aliases_and_hugging_face_ids_gets_each_name_back(served, tmp_path):
    b, _ = served
    # 200 items a chunk: chunk 0 gives one alias throughout, chunk 1 mixes every name of both
    # models, chunk 2 gives the models' own names, and one line names a model not served
    names = ["gpt-4o-mini"] * 200
    names += [(*CHAT_NAMES, *EMBED_NAMES)[i % 5] for i in range(200)]
    names += [LLAMA] * 49 + ["gpt-5"]
    given = write_requests(tmp_path / "in.jsonl", names)
    done = submit(b.config, tmp_path / "in.jsonl", "--job-id", "named")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out.jsonl"
    fetched = fetch(b, "named", out, "--follow")
    assert fetched.returncode == 0, fetched.stderr
    bodies = outputs(out)
    assert set(bodies) == set(given) - {"c449"}
    for custom_id, body in bodies.items():
        assert body["model"] == given[custom_id], custom_id
        kind = CreateEmbeddingResponse if given[custom_id] in EMBED_NAMES else ChatCompletion
        kind.model_validate(body)
    # the journal keeps the names per chunk: one alias throughout (no per-line list), a mix
    # (one entry per line), the models' own names (nothing)
    journal = JobFiles(b.data_dir.root).journal_path("named")
    commits = [r for r, _ in journal_records(journal)[0] if r["e"] == "commit"]
    kept = [(r.get("names"), "name_ix" in r) for r in sorted(commits, key=lambda r: r["c"])]
    assert kept == [
        (["gpt-4o-mini"], False),
        (["gpt-4o-mini", "llama:8b", "text-embedding-3-small"], True),
        (None, False),
    ]
    errors = Path(f"{out}.errors.jsonl").read_text().splitlines()
    assert [json.loads(e)["custom_id"] for e in errors] == ["c449"]
    assert job_info(b, "named")["failed"] == 1

    # aliases were resolved at ingest: every segment is a model's, under its own name
    files = list(b.data_dir.segments.iterdir())
    assert files and all(p.is_file() for p in files)  # a '/' never made a directory
    models = set()
    for path in b.data_dir.segments.glob("in-*.seg"):
        with Segment.open(path) as seg:
            models.add(seg.key.name)
            assert path.name == segment_file_name(seg.segment_id, seg.key)
            assert f".{file_safe(seg.key.name)}.s" in path.name
    assert models == {LLAMA, E5}


def test_the_openai_client_lists_the_models_and_runs_a_batch_under_an_alias(served, tmp_path):
    _, client = served
    listed = client.models.list()
    served_ids = [LLAMA, "gpt-4o-mini", "llama:8b", E5, "text-embedding-3-small"]
    assert [m.id for m in listed.data][-5:] == served_ids  # after write_config's own models
    assert all(m.object == "model" and m.owned_by for m in listed.data)
    assert client.models.retrieve(LLAMA).id == LLAMA  # sent as meta-llama%2FLlama-3.1-...
    alias = client.models.retrieve("gpt-4o-mini")
    assert alias.id == "gpt-4o-mini" and alias.model_extra["root"] == LLAMA
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-5")
    assert refused.value.code == "model_not_found"

    given = write_requests(tmp_path / "in.jsonl", [CHAT_NAMES[i % 3] for i in range(60)])
    file = client.files.create(
        file=("in.jsonl", (tmp_path / "in.jsonl").read_bytes()), purpose="batch"
    )
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

    def done():
        batch = client.batches.retrieve(created.id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    finished = wait_for(done, "the batch to end", timeout_s=120, interval_s=0.3)
    assert finished.status == "completed" and finished.error_file_id is None, finished
    out = tmp_path / "out.jsonl"
    out.write_bytes(client.files.content(finished.output_file_id).content)
    bodies = outputs(out)
    assert set(bodies) == set(given)
    for custom_id, body in bodies.items():
        assert ChatCompletion.model_validate(body).model == given[custom_id]


def test_an_embedding_alias_fills_the_store_named_after_its_model(served, tmp_path):
    b, _ = served
    write_requests(tmp_path / "in.jsonl", ["text-embedding-3-small"] * 40)
    done = submit(b.config, tmp_path / "in.jsonl", "--job-id", "vec", "--deliver", "vectors")
    assert done.returncode == 0, done.stderr
    delivered = b.data_dir.root / "vectors" / "delivered" / "vec"
    wait_for(delivered.exists, "the job to be delivered to its store", timeout_s=90)
    store = b.data_dir.root / "vectors" / file_safe(E5)
    assert (store / "store.json").is_file()  # vectors/intfloat%2Fe5-mistral-7b-instruct/
    stats = run_cli("vectors", "stats", "--json", "--config", str(b.config))
    assert stats.returncode == 0, stats.stderr
    rows = {s["name"]: s["rows"] for s in json.loads(stats.stdout)["stores"]}
    assert rows == {E5: 40}
    export = run_cli(
        "vectors", "export", "--store", E5, "-o", str(tmp_path / "v.npy"), "--config", str(b.config)
    )
    assert export.returncode == 0, export.stderr


def test_run_batch_with_an_alias_runs_a_file_written_for_openai(tmp_path):
    names = ["gpt-4o-mini"] * 30 + [LLAMA] * 5
    given = write_requests(tmp_path / "in.jsonl", names)
    out = tmp_path / "out.jsonl"
    args = ("--model", LLAMA, "--engine", "echo", "--alias", "gpt-4o-mini", "--alias", "gpt-4o")
    proc = batch(str(tmp_path / "in.jsonl"), "-o", str(out), *args, log=tmp_path / "batch.err")
    assert proc.wait(timeout=240) == exitcodes.OK, (tmp_path / "batch.err").read_text()
    bodies = outputs(out)
    assert {k: b["model"] for k, b in bodies.items()} == given


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--model", "my model", "--engine", "echo"), "--model 'my model' holds ' '"),
        (("--model", LLAMA, "--engine", "echo", "--alias", "../gpt"), "--alias '../gpt' starts"),
        (("--model", LLAMA, "--engine", "mystery"), "--engine mystery is not an engine"),
    ],
    ids=["model", "alias", "engine"],
)
def test_run_batch_names_the_flag_not_its_generated_config(tmp_path, flags, named):
    (tmp_path / "in.jsonl").write_text(json.dumps(request(0, LLAMA)) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "batch",
            str(tmp_path / "in.jsonl"),
            "-o",
            str(tmp_path / "out.jsonl"),
            *flags,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode != exitcodes.OK
    assert named in done.stderr and "batch.toml" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("models", "said"),
    [
        ('name = "my model"\nengine = "echo"', "models[0].name = \"my model\" holds ' '"),
        (f'name = "{"x" * 65}"\nengine = "echo"', "more than the 64 of a segment header's name"),
        ('name = "a"\nengine = "echo"\naliases = ["org/../b"]', "has a '..' segment"),
        (
            'name = "a"\nengine = "echo"\naliases = ["gpt-4o-mini"]\n[[models]]\n'
            'name = "b"\nengine = "echo"\naliases = ["gpt-4o-mini"]',
            'models[1].aliases = ["gpt-4o-mini"] has "gpt-4o-mini", which is an alias of models[0]',
        ),
        (
            f'name = "{LLAMA}"\nengine = "echo"\n[[models]]\nname = "b"\nengine = "echo"\n'
            f'aliases = ["{LLAMA}"]',
            f'models[1].aliases = ["{LLAMA}"] has "{LLAMA}", which is the name of models[0]',
        ),
    ],
    ids=["character", "length", "dot-dot", "alias-twice", "alias-is-a-name"],
)
def test_a_broker_refuses_a_bad_model_name_or_alias_naming_it(tmp_path, models, said):
    config = tmp_path / "bad.toml"
    config.write_text(f'[broker]\ndata_dir = "{tmp_path / "data"}"\n[[models]]\n{models}\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    assert said in str(refused.value) and str(config) in str(refused.value)
    proc = zygote.Popen(
        [sys.executable, str(REPO / "run.py"), "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.CONFIG and said in err, err


def test_names_valid_before_keep_their_file_names_and_new_ones_never_make_a_path():
    for name in ("minilm", "all-MiniLM-L6-v2", "e5_large.v2", "job-0042", "A.b-c_d"):
        assert file_safe(name) == name  # data dirs written before read as they were
    key = SegmentKey(KIND_INPUT, "minilm", shape=3, lane=512)
    assert segment_file_name(42, key) == "in-000000000042.minilm.s3.l512.seg"
    for name in (LLAMA, "ft:gpt-4o-mini:org::x1", "a%2Fb", "..", ".", "naïve/名"):
        safe = file_safe(name)
        assert "/" not in safe and safe not in (".", "..") and from_file_safe(safe) == name
    assert file_safe("a/b") != file_safe("a_b") != file_safe("a%2Fb")
