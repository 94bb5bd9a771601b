"""Result reuse through a real broker: `submit --reuse` twice, one thing varied at a time, and
the whole broker SIGKILLed while a reusing job is half done.

Items a worker received are counted by dispatch (`fabric_items_dispatched_total{model}`);
reused lines by `status JOB --json` (`reused`) and `fabric_items_reused_total{model}`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from broker import WORDS, Broker, free_port, submit, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for
from test_dispatch_pipeline import assert_each_once, fetch, job_info

from pipeline.core import exitcodes
from pipeline.store.datadir import DataDir

EMBED = "/v1/embeddings"
CHAT = "/v1/chat/completions"
GEN_MODEL = """
[[models]]
name = "gen"
engine = "echo"
endpoints = ["/v1/chat/completions"]
"""
WORKERS = """[[workers]]
model = "sim"
simulated_tokens_per_s = {rate}
[[workers]]
model = "gen"
"""


def start(tmp_path: Path, rate: float = 5e6, revision: str = "", api_port: int = 0) -> Broker:
    config = tmp_path / "broker.toml"
    if not config.exists():
        api = f'[api]\nenabled = true\nbind = "127.0.0.1:{api_port}"\n' if api_port else ""
        config = write_config(tmp_path, extra=api)
        text = config.read_text().replace("[workers]\nlocal = 0\n", WORKERS.format(rate=rate))
        config.write_text(text + GEN_MODEL)
    text = config.read_text()
    if revision:  # the operator declares new weights for `sim`
        text = text.replace('name = "sim"\n', f'name = "sim"\nrevision = "{revision}"\n')
    config.write_text(text)
    b = Broker(config, stderr_path=tmp_path / f"broker-{time.monotonic_ns()}.err")
    return b.start()


def embed_line(i: int, text: str | None = None, **body) -> dict:
    words = text if text is not None else " ".join(WORDS[i % 300 : i % 300 + 2 + i % 7])
    body = {"model": "sim", "input": words, **body}
    return {"custom_id": f"e{i}", "method": "POST", "url": EMBED, "body": body}


def chat_line(i: int, **body) -> dict:
    body = {"model": "gen", "prompt_token_ids": [1 + i % 90, 2 + i % 7, 3], **body}
    return {"custom_id": f"g{i}", "method": "POST", "url": CHAT, "body": body}


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(b: Broker, path: Path, out: Path, *args: str) -> dict:
    """Submit `path` (with `args`), wait until it completes, fetch it to `out`; its status."""
    done = submit(b.config, path, *args)
    assert done.returncode == exitcodes.OK, done.stderr
    job = done.stdout.strip().splitlines()[-1]
    info = wait_for(
        lambda: (i := job_info(b, job))["state"] == "completed" and i, f"job {job} to complete"
    )
    assert fetch(b, job, out).returncode == exitcodes.OK
    assert info["failed"] == 0, out.with_name(f"{out.name}.errors.jsonl").read_text()
    return info


def bodies(out: Path) -> dict[str, dict]:
    """custom_id -> response body less what differs by run (its id, created)."""
    found = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        body = record["response"]["body"]
        body.pop("id", None)
        body.pop("created", None)
        found[record["custom_id"]] = body
    return found


def dispatched(b: Broker, model: str) -> float:
    return b.metric("fabric_items_dispatched_total", model=model)


SENTINEL = {"sim": "gen", "gen": "sim"}


def sent_to_workers(b: Broker, model: str, path: Path, out: Path, *args: str) -> tuple[int, dict]:
    """Run `path` as `run` does; (the items of `model` workers received meanwhile, its status).

    Dispatch reports its counters a second at a time, all models in one report: a one-line
    job of another model after it, seen in the counters, says the report holds the run too."""
    other = SENTINEL[model]
    before, before_other = dispatched(b, model), dispatched(b, other)
    info = run(b, path, out, *args)
    line = embed_line(10**6 + time.monotonic_ns() % 10**6) if other == "sim" else chat_line(0)
    run(b, write(out.with_suffix(".sentinel"), [line]), out.with_suffix(".sentinel.out"))
    wait_for(lambda: dispatched(b, other) > before_other, "dispatch's report of the run")
    return int(dispatched(b, model) - before), info


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reuse")
    b = start(tmp_path, api_port=free_port())
    try:
        yield b
        assert b.stop() == exitcodes.OK, b.stderr
        assert_check_clean(b.data_dir)
    finally:
        b.close()


def test_a_file_run_twice_with_reuse_runs_only_what_changed(broker, tmp_path):
    b = broker
    n = 300
    lines = [embed_line(i) for i in range(n)]
    path = write(tmp_path / "in.jsonl", lines)
    sent, first = sent_to_workers(b, "sim", path, tmp_path / "first.jsonl", "--reuse")
    assert sent == n and first["reused"] == 0
    # again: no item of the file reaches a worker; every line has the first run's body
    sent, second = sent_to_workers(b, "sim", path, tmp_path / "second.jsonl", "--reuse")
    assert sent == 0
    assert second["reused"] == n and second["total"] == n and second["failed"] == 0
    assert bodies(tmp_path / "second.jsonl") == bodies(tmp_path / "first.jsonl")
    assert_each_once(tmp_path / "second.jsonl", n)
    assert second["usage"] == first["usage"]  # usage as first measured
    assert b.metric("fabric_items_reused_total", model="sim") >= n
    shown = run_cli("status", second["job"], "--config", str(b.config))
    assert f"reused     {n} lines" in shown.stdout, shown.stdout
    # one line's text changed: that line runs, the others are reused
    lines[7] = embed_line(7, text="w1 w2 w3 w999")
    sent, third = sent_to_workers(
        b, "sim", write(tmp_path / "in3.jsonl", lines), tmp_path / "third.jsonl", "--reuse"
    )
    assert sent == 1 and third["reused"] == n - 1
    # a line's encoding changes only how delivery writes the stored vector
    base64 = [embed_line(i, encoding_format="base64") for i in range(5)]
    sent, fourth = sent_to_workers(
        b, "sim", write(tmp_path / "in4.jsonl", base64), tmp_path / "fourth.jsonl", "--reuse"
    )
    assert sent == 0 and fourth["reused"] == 5
    assert all(
        isinstance(x["data"][0]["embedding"], str)
        for x in bodies(tmp_path / "fourth.jsonl").values()
    )
    # without --reuse, everything runs
    sent, plain = sent_to_workers(b, "sim", path, tmp_path / "plain.jsonl")
    assert sent == n and plain["reused"] is None


def test_a_parameter_or_a_sampled_request_without_seed_runs_again(broker, tmp_path):
    b = broker
    greedy = [chat_line(i, temperature=0, max_tokens=4) for i in range(20)]
    sent, _ = sent_to_workers(
        b, "gen", write(tmp_path / "g.jsonl", greedy), tmp_path / "g1.jsonl", "--reuse"
    )
    assert sent == 20
    sent, again = sent_to_workers(b, "gen", tmp_path / "g.jsonl", tmp_path / "g2.jsonl", "--reuse")
    assert sent == 0 and again["reused"] == 20
    assert bodies(tmp_path / "g2.jsonl") == bodies(tmp_path / "g1.jsonl")
    # one parameter changed (max_tokens): every line runs
    longer = [chat_line(i, temperature=0, max_tokens=5) for i in range(20)]
    sent, info = sent_to_workers(
        b, "gen", write(tmp_path / "l.jsonl", longer), tmp_path / "l1.jsonl", "--reuse"
    )
    assert sent == 20 and info["reused"] == 0
    # sampled without a seed: never reused, not even the second time
    sampled = [chat_line(i, temperature=0.7, max_tokens=4) for i in range(20)]
    write(tmp_path / "s.jsonl", sampled)
    sent, _ = sent_to_workers(b, "gen", tmp_path / "s.jsonl", tmp_path / "s1.jsonl", "--reuse")
    assert sent == 20
    sent, info = sent_to_workers(b, "gen", tmp_path / "s.jsonl", tmp_path / "s2.jsonl", "--reuse")
    assert sent == 20 and info["reused"] == 0
    # sampled with a fixed seed: deterministic, reused
    seeded = [chat_line(i, temperature=0.7, seed=5, max_tokens=4) for i in range(20)]
    write(tmp_path / "d.jsonl", seeded)
    sent, _ = sent_to_workers(b, "gen", tmp_path / "d.jsonl", tmp_path / "d1.jsonl", "--reuse")
    assert sent == 20
    sent, info = sent_to_workers(b, "gen", tmp_path / "d.jsonl", tmp_path / "d2.jsonl", "--reuse")
    assert sent == 0 and info["reused"] == 20


def test_new_weights_run_again_and_a_broker_killed_mid_job_delivers_each_line_once(tmp_path):
    n, old = 400, 200
    lines = [embed_line(i) for i in range(n)]
    b = start(tmp_path, rate=2_000.0)  # slow enough to kill it with work in flight
    try:
        run(b, write(tmp_path / "old.jsonl", lines[:old]), tmp_path / "o1.jsonl", "--reuse")
        done = submit(b.config, write(tmp_path / "all.jsonl", lines), "--reuse")
        assert done.returncode == exitcodes.OK, done.stderr
        job = done.stdout.strip().splitlines()[-1]
        wait_for(lambda: 0 < job_info(b, job)["completed"] < n, "the job half done")
        b.kill()  # the whole broker, SIGKILL
        b.close()
        assert_check_clean(
            b.data_dir
        )  # found lines not stored yet are not lost: the journal has them
        b = start(tmp_path, rate=2_000.0)
        info = wait_for(
            lambda: (i := job_info(b, job))["state"] == "completed" and i,
            "the job to complete after the restart",
            timeout_s=60,
        )
        assert info["reused"] == old and info["failed"] == 0
        assert fetch(b, job, tmp_path / "all1.jsonl").returncode == exitcodes.OK
        assert_each_once(tmp_path / "all1.jsonl", n)
        assert b.stop() == exitcodes.OK
        assert_check_clean(b.data_dir)
        b.close()
        # the operator declares new weights for `sim`: nothing of it is reused
        b = start(tmp_path, revision="2026-12-07")
        sent, info = sent_to_workers(
            b, "sim", tmp_path / "old.jsonl", tmp_path / "o2.jsonl", "--reuse"
        )
        assert sent == old and info["reused"] == 0
        assert b.stop() == exitcodes.OK
        assert_check_clean(b.data_dir)
    finally:
        b.close()


def test_batch_runs_share_one_index_so_a_changed_input_runs_only_its_changes(tmp_path):
    from test_oneshot import RUN_BOUND_S, batch

    def completions(n: int, changed: int = 0) -> list[dict]:
        lines = []
        for i in range(n):
            ids = [1 + i % 50, 2 + i % 13, 3] if i >= changed else [7, 7, 7, 100 + i]
            body = {"model": "echo", "prompt_token_ids": ids, "temperature": 0, "max_tokens": 3}
            lines.append(
                {"custom_id": f"e{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        return lines

    index, log = tmp_path / "index", tmp_path / "batch.err"
    runs = [("a", completions(100)), ("b", completions(100, changed=10))]
    for name, lines in runs:
        args = (str(write(tmp_path / f"{name}.jsonl", lines)), "-o", str(tmp_path / f"{name}.out"))
        proc = batch(*args, "--model", "echo", "--reuse", "--reuse-index", str(index), log=log)
        assert proc.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
    said = log.read_text()
    assert "(0 errors, 0 reused)" in said and "(0 errors, 90 reused)" in said, said
    first, second = bodies(tmp_path / "a.out"), bodies(tmp_path / "b.out")
    assert len(second) == 100 and all(second[k] == first[k] for k in second if int(k[1:]) >= 10)
    assert all(second[f"e{i}"] != first[f"e{i}"] for i in range(10))
    for name, _ in runs:
        assert_check_clean(DataDir(tmp_path / f"{name}.out.fabric" / "data"))


def test_an_http_batch_asks_for_reuse_in_its_metadata_and_says_how_many_lines_took_it(
    broker, tmp_path
):
    import openai

    b = broker
    client = openai.OpenAI(base_url=f"http://{b.settings.api.bind}/v1", api_key="k", max_retries=0)
    lines = [embed_line(5000 + i) for i in range(30)]
    file = client.files.create(
        file=("in.jsonl", write(tmp_path / "in.jsonl", lines).read_bytes()), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=file.id,
            endpoint=EMBED,
            completion_window="24h",
            metadata={"fabric_reuse": "yes"},
        )
    assert "fabric_reuse" in str(refused.value)

    def batch_run(name: str):
        created = client.batches.create(
            input_file_id=file.id,
            endpoint=EMBED,
            completion_window="24h",
            metadata={"fabric_reuse": "true"},
        )

        def done():
            batch = client.batches.retrieve(created.id)
            return (
                batch if batch.status in ("completed", "failed", "expired", "cancelled") else None
            )

        finished = wait_for(done, "the batch to end", timeout_s=60)
        assert finished.status == "completed", finished
        out = tmp_path / name
        out.write_bytes(client.files.content(finished.output_file_id).content)
        return finished, bodies(out)

    first, first_bodies = batch_run("first.jsonl")
    second, second_bodies = batch_run("second.jsonl")
    assert first.metadata["fabric_reused"] == "0" and second.metadata["fabric_reused"] == "30"
    assert second.request_counts.completed == 30 and second_bodies == first_bodies
