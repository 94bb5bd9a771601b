"""The same batch files through every door, on every engine: the doors must agree.

Each door used to be tested alone, with checks that took an empty string for a text; so the
HTTP door's empty texts and a delivery that crashed on a file mixing `/v1/responses` with
fan-out lines went unseen. Here the collection in tests/data/doors/ (its README says what each
file covers) goes through the three doors a user has, on each engine:

| door | how |
|------|-----|
| `submit` | `run.py submit FILE` and `run.py results JOB --follow`, a job per file, on the engine's broker |
| `batch` | `run.py batch` (a private broker of its own), once, on the engine's files joined into one |
| `http` | the official `openai` client on the same broker's api: a batch per file and url (a batch has one endpoint, as OpenAI's), with `fabric_accept_partial` so that bad lines become error lines, as in the other doors |

Engines: echo and transformers (SmolLM2) run the generation files (model `gen`), minilm the
embedding files (model `embed`), vllm the generation files where vLLM is there (on a GPU or
its CPU build, SmolLM2 by default; marked `vllm`, skipped with the reason otherwise). Each model also answers to aliases (`[[models]]
aliases`; `run.py batch --alias`), and one file per model names it only by them; `GET
/v1/models` lists both.

Per door: each `custom_id` comes back exactly once; the lines that must fail fail with their
code and every other line has a result; every body validates with the `openai` package's types
and names the model its line named; every generated text is non-empty and is its token ids
decoded with the model's tokenizer (every embedding one vector per input). Across doors: the
bodies are equal but for ids and timestamps, and so are the error codes.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai
import orjson
import pytest
from broker import REPO, Broker, free_port, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean
from openai._models import construct_type
from openai.lib._parsing._embeddings import parse_embedding_response
from openai.types import BatchError
from openai.types.responses import Response
from smollm2 import MODEL_MARKS, model_dir, shared_root
from test_api_broker import BODY_TYPES as OPENAI_TYPES
from test_api_broker import finish, lines_of, upload
from test_dispatch_pipeline import cli
from tokenizers import Tokenizer
from vllm_runs import GENERATE_MODEL, VLLM_MARKS
from vllm_runs import model_toml as vllm_model_toml

from gpu.engines.smollm2_dir import SMOLLM2
from pipeline.core import exitcodes

COLLECTION = Path(__file__).parent / "data" / "doors"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
BODY_TYPES = {**OPENAI_TYPES, RESPONSES: Response}  # url -> openai's type
DOORS = ("submit", "batch", "http")
MINILM_DIM = 384

EMBED_FILES = ("embeddings.jsonl", "embed-alias.jsonl")
GEN_FILES = (
    "chat.jsonl",
    "completions.jsonl",
    "responses.jsonl",
    "mixed.jsonl",
    "gen-alias.jsonl",
    "errors.jsonl",
)
ALIASES = {
    "embed": ("text-embedding-3-small",),
    "gen": ("gpt-4o-mini", "meta-llama/Llama-3.1-8B-Instruct"),
}
MINILM_TOKENIZER = REPO / "gpu" / "minilm" / "tokenizer.json"
SMOLLM2_TOKENIZER = REPO / "gpu" / "smollm2" / "tokenizer.json"
# The lines that must fail, on every engine and through every door, with their codes.
MUST_FAIL = {
    "bad-emb-dimensions": "unsupported_parameter",
    "bad-model": "unknown_model",
    "bad-url": "unknown_url",
    "bad-parameter": "unsupported_parameter",
}


@dataclass(frozen=True)
class Case:
    """One engine and the model of the collection it runs."""

    engine: str
    model: str  # "embed" or "gen": the name the collection's files use
    files: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)  # more lines it must fail: code
    max_tokens: int = 32768  # the model's prompt limit, as `run.py batch --model` writes it


CASES = {
    "echo": Case(
        "echo",
        "gen",
        GEN_FILES,
        # echo gives no log probabilities: a line asking for them is refused (docs/input-format.md)
        {"chat-logprobs": "unsupported_parameter", "resp-logprobs": "unsupported_parameter"},
    ),
    "minilm": Case("minilm", "embed", EMBED_FILES, max_tokens=256),
    "transformers": Case("transformers", "gen", GEN_FILES, max_tokens=8192),
    "vllm": Case("vllm", "gen", GEN_FILES),  # its tables: tests/vllm_runs.py `model_toml`
}
ENGINES = [
    pytest.param("echo"),
    pytest.param("minilm"),
    pytest.param("transformers", marks=MODEL_MARKS),  # the SmolLM2 process (tests/smollm2.py)
    pytest.param(
        "vllm",
        marks=(*VLLM_MARKS, pytest.mark.timeout(1800)),  # its broker: tests/vllm_runs.py's
        # `vllm_broker`, shared with tests/test_vllm_broker.py; skipped, with the reason,
        # without vLLM (tests/vllm_runs.py `vllm_host`)
    ),
]
pytestmark = pytest.mark.timeout(600)  # a case's first test starts its broker and runs a door


# ---- the collection --------------------------------------------------------------------------
def read_lines(files: tuple[str, ...]) -> list[dict]:
    return [
        json.loads(text)
        for name in files
        for text in (COLLECTION / name).read_text("utf-8").splitlines()
    ]


def by_url(path: Path) -> dict[str, list[bytes]]:
    """The file's lines grouped by url, in file order; a line whose url is no endpoint goes with
    the first url's (where it becomes its `unknown_url` error line)."""
    groups: dict[str, list[bytes]] = {}
    strays = []
    for raw in path.read_bytes().splitlines(keepends=True):
        url = orjson.loads(raw)["url"]
        if url in BODY_TYPES:
            groups.setdefault(url, []).append(raw)
        else:
            strays.append(raw)
    if strays:
        groups[next(iter(groups))] += strays
    return groups


# ---- the engine's broker ---------------------------------------------------------------------
def model_toml(case: Case, tmp_path_factory) -> str:
    """The case's model (with its aliases) and a local worker group for it."""
    if case.engine == "vllm":  # the shared vllm broker's tables
        return vllm_model_toml(ALIASES[case.model])
    options = engine_options(case, tmp_path_factory)
    aliases = ", ".join(f'"{a}"' for a in ALIASES[case.model])
    shown = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    return f"""
[[models]]
name = "{case.model}"
engine = "{case.engine}"
tokenizer = "{tokenizer_path(case)}"
max_tokens = {case.max_tokens}
aliases = [{aliases}]
[[workers]]
model = "{case.model}"
target_batch_s = 0
options = {{{shown}}}
"""


def engine_options(case: Case, tmp_path_factory) -> dict:
    if case.engine == "transformers":  # the saved weights load in a second (tests/smollm2.py)
        return {"model": str(model_dir(shared_root(tmp_path_factory))), "threads": 1}
    if case.engine == "vllm":  # tests/vllm_runs.py `model_toml` writes its options
        return {"model": GENERATE_MODEL}
    return {}


def tokenizer_path(case: Case) -> Path:
    if case.model == "embed":
        return MINILM_TOKENIZER
    if case.engine != "vllm" or GENERATE_MODEL == SMOLLM2:
        return SMOLLM2_TOKENIZER  # echo's too: it echoes SmolLM2's token ids of the prompt
    local = Path(GENERATE_MODEL) / "tokenizer.json"
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download

    hf_hub_download(GENERATE_MODEL, "tokenizer_config.json")  # its chat template, beside it
    return Path(hf_hub_download(GENERATE_MODEL, "tokenizer.json"))


def case_config(tmp_path: Path, case: Case, tmp_path_factory, api_port: int | None) -> Path:
    """tests/broker.py's config, the case's model and worker, and the api when `api_port`."""
    tmp_path.mkdir()
    extra = "" if api_port is None else f'[api]\nenabled = true\nbind = "127.0.0.1:{api_port}"\n'
    config = write_config(tmp_path, extra=extra, workers=0)
    text = config.read_text().replace("[workers]\nlocal = 0\n", "")
    config.write_text(text + model_toml(case, tmp_path_factory))
    return config


@dataclass
class Served:
    """An engine's broker (the submit and http doors), and each door's delivery, made once."""

    case: Case
    broker: Broker
    client: openai.OpenAI
    tmp: Path
    tmp_path_factory: pytest.TempPathFactory
    runs: dict[str, Delivery | str] = field(default_factory=dict)


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tmp_path_factory):
    """One broker per engine, with the api on, for the submit and http doors; at the end it
    must stop cleanly and its data dir check clean."""
    case = CASES[request.param]
    tmp = tmp_path_factory.mktemp(f"doors-{case.engine}")
    if case.engine == "vllm":  # the shared broker (tests/vllm_runs.py): stopped as they end
        broker = request.getfixturevalue("vllm_broker")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{broker.api_port}/v1", api_key="any", max_retries=0
        )
        yield Served(case, broker, client, tmp, tmp_path_factory)
        return
    port = free_port()
    config = case_config(tmp / "broker", case, tmp_path_factory, port)
    broker = Broker(config, stderr_path=tmp / "broker.err").start(timeout_s=60)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="any", max_retries=0)
    try:
        yield Served(case, broker, client, tmp, tmp_path_factory)
        assert broker.stop() == exitcodes.OK, broker.stderr
    finally:
        broker.close()
    assert_check_clean(broker.data_dir)


# ---- the doors ---------------------------------------------------------------------------------
@dataclass
class Delivery:
    """What one door delivered for the collection: output lines and error lines."""

    out: list[dict]
    err: list[dict]

    def outputs(self) -> dict[str, dict]:
        return {line["custom_id"]: line for line in self.out}

    def errors(self) -> dict[str, dict]:
        return {line["custom_id"]: line for line in self.err}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def through_submit(served: Served) -> Delivery:
    """A job per file (`run.py submit`), then `run.py results --follow` of each."""
    b, tmp = served.broker, served.tmp / "submit"
    tmp.mkdir()
    jobs = []
    for name in served.case.files:
        job = "doors-" + name.removesuffix(".jsonl")
        given = tmp / name  # submit writes the rejected lines beside its input: not in the repo
        shutil.copyfile(COLLECTION / name, given)
        done = submit(b.config, given, "--job-id", job)
        assert done.returncode == 0, f"submit {name}: {done.stderr}"
        jobs.append(job)
    delivery = Delivery([], [])
    for job in jobs:
        out = tmp / f"{job}.jsonl"
        fetched = cli(b, "results", job, "-o", str(out), "--follow")
        assert fetched.returncode == 0, (
            f"results {job} exited {fetched.returncode}: {fetched.stderr}"
        )
        delivery.out += jsonl(out)
        delivery.err += jsonl(Path(f"{out}.errors.jsonl"))
    return delivery


def through_batch(served: Served) -> Delivery:
    """`run.py batch` on the case's files joined into one (each run starts a private broker).

    A model on an engine without options runs as `--model M --engine E --alias A`; one whose
    worker needs engine options (transformers: the saved weights, else it parses the GGUF for
    half a minute of CPU; vllm: its share of the GPU) runs with `--config`, the same model and
    worker tables as the case's broker, its aliases in the config (`--model` takes no engine
    options)."""
    case, tmp = served.case, served.tmp / "batch"
    tmp.mkdir()
    joined = tmp / "collection.jsonl"
    joined.write_bytes(b"".join((COLLECTION / name).read_bytes() for name in case.files))
    if engine_options(case, served.tmp_path_factory):
        config = case_config(tmp / "broker", case, served.tmp_path_factory, api_port=None)
        how = ["--config", str(config)]
    else:
        how = ["--model", case.model, "--engine", case.engine]
        how += ["--tokenizer", str(tokenizer_path(case))]
        for alias in ALIASES[case.model]:
            how += ["--alias", alias]
    out = tmp / "out.jsonl"
    done = run_cli("batch", str(joined), "-o", str(out), *how)
    assert done.returncode == exitcodes.OK, f"run.py batch exited {done.returncode}: {done.stderr}"
    return Delivery(jsonl(out), jsonl(Path(f"{out}.errors.jsonl")))


def through_http(served: Served) -> Delivery:
    """The official openai client: a batch per file and url, all created, then each finished."""
    client, tmp = served.client, served.tmp / "http"
    tmp.mkdir()
    batches = []
    for name in served.case.files:
        for url, lines in by_url(COLLECTION / name).items():
            part = tmp / f"{name.removesuffix('.jsonl')}-{url.rsplit('/', 1)[1]}.jsonl"
            part.write_bytes(b"".join(lines))
            made = client.batches.create(
                input_file_id=upload(client, part).id,
                endpoint=url,
                completion_window="24h",
                metadata={"fabric_accept_partial": "true"},
            )
            batches.append((part.name, made.id))
    delivery = Delivery([], [])
    for name, batch_id in batches:
        batch = finish(client, batch_id, timeout_s=300)
        assert batch.status == "completed", f"the batch of {name}: {batch}"
        delivery.out += lines_of(client, batch.output_file_id)
        delivery.err += lines_of(client, batch.error_file_id)
    return delivery


THROUGH = {"submit": through_submit, "batch": through_batch, "http": through_http}


def delivered(served: Served, door: str) -> Delivery:
    """The door's delivery of the case's collection, run at the first test that asks; a door
    that failed fails every test that asks for it, with why (it is not run again)."""
    if door not in served.runs:
        try:
            served.runs[door] = THROUGH[door](served)
        except Exception as exc:  # kept: every test on this door fails with it
            served.runs[door] = f"the {door} door did not deliver: {type(exc).__name__}: {exc}"
    run = served.runs[door]
    if isinstance(run, str):
        pytest.fail(run, pytrace=False)
    return run


# ---- each door -------------------------------------------------------------------------------
@pytest.mark.parametrize("door", DOORS)
def test_each_custom_id_comes_back_exactly_once(served, door):
    got = delivered(served, door)
    counts = Counter(line["custom_id"] for line in got.out + got.err)
    want = Counter(line["custom_id"] for line in read_lines(served.case.files))
    assert counts == want


@pytest.mark.parametrize("door", DOORS)
def test_the_lines_that_must_fail_fail_and_every_other_line_has_a_result(served, door):
    got = delivered(served, door)
    must_fail = {**MUST_FAIL, **served.case.refused}
    outcomes = {k: "result" for k in got.outputs()}
    outcomes |= {k: line["error"]["code"] for k, line in got.errors().items()}
    want = {
        line["custom_id"]: must_fail.get(line["custom_id"], "result")
        for line in read_lines(served.case.files)
    }
    wrong = {k: f"{outcomes.get(k)} (want {v})" for k, v in want.items() if outcomes.get(k) != v}
    assert not wrong, {k: (v, got.errors().get(k)) for k, v in wrong.items()}


@pytest.mark.parametrize("door", DOORS)
def test_every_body_validates_with_openais_types_and_names_its_lines_model(served, door):
    got = delivered(served, door)
    lines = {line["custom_id"]: line for line in read_lines(served.case.files)}
    for custom_id, line in got.outputs().items():
        asked = lines[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        typed(asked, body)
        assert body["model"] == asked["body"]["model"], (custom_id, body["model"])
    for line in got.err:
        assert line["response"] is None, line
        error = BatchError.model_validate(line["error"])
        assert error.code and error.message, line


@pytest.mark.parametrize("door", DOORS)
def test_every_generated_text_is_its_token_ids_decoded_and_every_input_has_a_vector(served, door):
    got = delivered(served, door)
    lines = {line["custom_id"]: line for line in read_lines(served.case.files)}
    tokenizer = Tokenizer.from_file(str(tokenizer_path(served.case)))
    empty, undecoded = [], []
    for custom_id, line in got.outputs().items():
        asked, body = lines[custom_id], line["response"]["body"]
        if asked["url"] == EMBEDDINGS:
            vectors = [embedding(d["embedding"]) for d in body["data"]]
            assert [d["index"] for d in body["data"]] == list(range(parts(asked))), custom_id
            assert all(len(v) == MINILM_DIM and np.isfinite(v).all() for v in vectors), custom_id
            continue
        texts = list(generated(body))
        if asked["url"] != RESPONSES:
            assert [where for where, _, _ in texts] == [
                f"choices[{p}]" for p in range(parts(asked))
            ], custom_id
        for where, text, token_ids in texts:
            if not text:
                empty.append(f"{custom_id} {where}")
            if text != tokenizer.decode(token_ids):
                undecoded.append(f"{custom_id} {where}: {text!r} for {token_ids}")
    assert not empty, f"empty generated texts: {empty}"
    assert not undecoded, f"texts that are not their token ids decoded: {undecoded}"


def test_the_http_door_lists_each_model_with_its_aliases(served):
    listed = {model.id for model in served.client.models.list()}
    assert {served.case.model, *ALIASES[served.case.model]} <= listed


# ---- across doors ------------------------------------------------------------------------------
def test_the_doors_agree_on_every_body_and_error_code(served):
    """Output lines equal but for what names the job (`comparable`); error lines by their code
    (their messages name the line's number in the door's file and the broker's models, which
    differ per door: the batch door's private broker serves one)."""
    runs = {door: delivered(served, door) for door in DOORS}
    first, *others = DOORS
    for door in others:
        for custom_id, line in runs[first].outputs().items():
            theirs = runs[door].outputs().get(custom_id)
            assert theirs is not None, f"{custom_id}: a result through {first}, not through {door}"
            assert_alike(comparable(line), comparable(theirs), f"{custom_id} ({first} vs {door})")
        codes = {k: e["error"]["code"] for k, e in runs[first].errors().items()}
        assert {k: e["error"]["code"] for k, e in runs[door].errors().items()} == codes, door


# ---- helpers -----------------------------------------------------------------------------------
def typed(asked: dict, body: dict) -> None:
    """`body` validated with the openai package's type for its line's url (a base64 embedding
    decoded first by the package's own parser, as a client does)."""
    kind = BODY_TYPES[asked["url"]]
    if asked["body"].get("encoding_format") == "base64":
        packed = construct_type(type_=kind, value=body)
        assert all(isinstance(d.embedding, str) for d in packed.data), body
        body = parse_embedding_response(packed, encoding_format=openai.NOT_GIVEN).model_dump()
    kind.model_validate(body)


def parts(asked: dict) -> int:
    """How many results a line asks for: inputs (or prompts) times `n`."""
    body = asked["body"]
    prompt = body.get("input", body.get("prompt", body.get("prompt_token_ids")))
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return (len(prompt) if many else 1) * int(body.get("n") or 1)


def embedding(value) -> np.ndarray:
    """An embedding as floats: a list, or base64 of little-endian float32."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), "<f4")
    return np.asarray(value, np.float32)


def generated(body: dict):
    """(where, text, token ids) of each generated text of a chat, completion or Response body."""
    if body.get("object") == "response":
        [message] = body["output"]
        [content] = message["content"]
        yield "output[0]", content["text"], body["token_ids"]
        return
    for choice in body["choices"]:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        yield f"choices[{choice['index']}]", text, choice["token_ids"]


# What differs per door by design: the line's `id` and `request_id` and the body's `id` (and a
# Response's message id) are made from (job id, line index), and each door runs its own job
# (the batch door's joins the files, the http door's splits them by url); `created` and
# `created_at` are the job's creation time.
PER_DOOR_BODY_KEYS = ("id", "created", "created_at")


def comparable(line: dict) -> dict:
    """An output line without what differs per door, its base64 embeddings as floats."""
    line = copy.deepcopy(line)
    del line["id"]
    del line["response"]["request_id"]
    body = line["response"]["body"]
    for key in PER_DOOR_BODY_KEYS:
        body.pop(key, None)
    for item in body.get("output", []):
        item.pop("id", None)
    for datum in body.get("data", []):
        datum["embedding"] = embedding(datum["embedding"]).tolist()
    return line


def assert_alike(a, b, where: str) -> None:
    """Equal, but floats within 1e-5: an embedding or a log probability may differ in its last
    bits with the batch it ran in (tests/test_minilm.py: lane width and batching move a vector
    by less than that); names the first difference."""
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, int | float) and isinstance(b, int | float)
        assert ok and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_alike(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_alike(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
