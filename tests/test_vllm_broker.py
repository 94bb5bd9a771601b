"""The `vllm` engine in a real broker: a `[[workers]]` table with `engine = "vllm"`, serving
SmolLM2 on vLLM's CPU build (or a GPU), with no memory option (the engine picks the CPU
backend's share of RAM).

Marked `vllm` and skipped with the reason where vLLM is not importable (failed instead in CI:
tests/vllm_runs.py `require_vllm_host`). The broker is tests/vllm_runs.py's `vllm_broker`,
shared with tests/test_doors.py's vllm case (a vLLM start costs half a minute of CPU on 2
cores); its worker's options are the in-process engine's (`engine_options`: eager, float32),
so vLLM's own offline `LLM` (`started("generate")`) gives the reference answers, taken once
before the broker starts (`offline`).

| test | proves |
|------|--------|
| greedy lines | each completion's tokens are the ones `LLM.generate` gives for the same prompt ids at temperature 0: the same ids (the body's `token_ids`), text, each token's text (logprobs) and count (usage) |
| sampling | `n` > 1 with a seed: n choices, the same on a second job; `stop` strings cut the text before them; `max_tokens` bounds each choice; logprobs are vLLM's own |
| bad items | a prompt past the model's context and an id past its vocabulary get their own error lines from the engine's checks (the model's table gives ingest a longer limit and a larger vocabulary, so that both reach the worker); the other lines of the job get results |
| engine process killed | SIGKILL to vLLM's engine process mid-job: the worker hands its batches back and exits, the supervisor starts it again, every line ends exactly once, nothing dead-lettered |
| the broker stopped | vLLM's engine processes end with the worker (`Engine.close`), none left behind (tests/vllm_runs.py `SharedBroker.close`, as the vLLM tests end) |
| cannot start | a model directory that is not there, or 0.99 of the host's RAM (which vLLM's CPU backend refuses): `run.py batch` stops with the engine's own message, and `status` names it |
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from broker import Broker, submit
from conftest import wait_for
from test_dispatch_pipeline import assert_each_once, fetch, finished
from test_fanout import errors, line, outputs, write
from tokenizers import Tokenizer
from vllm_runs import (
    START_S,
    VLLM_MARKS,
    close_started,
    engine_processes,
    require_vllm_host,
    started,
)

from gpu.engines.smollm2_dir import smollm2_cache_dir, write_smollm2_dir
from gpu.engines.transformers import smollm2_tokenizer_path

pytestmark = list(VLLM_MARKS)
PROMPTS = ["The capital of France is", "Once upon a time, there", "1, 2, 3, 4,", "The sea is"]


@dataclass(frozen=True)
class Offline:
    """vLLM's own offline answers to the prompts (`PROMPTS`, as ids) the tests send."""

    greedy: list  # RequestOutput per prompt: temperature 0, 12 tokens
    counting: str  # prompt 2's text, greedy, 24 tokens: it reaches the stop string " 7"
    scored: object  # prompt 3's CompletionOutput, greedy, 6 tokens, with 2 logprobs a step
    decode: object  # vLLM's tokenizer's decode


@pytest.fixture(scope="session")
def offline() -> Offline:
    """vLLM's offline `LLM.generate` on the prompts, in process, with the workers' options;
    named before `vllm_broker` (fixtures of one scope start in the order a test names them),
    so that the in-process engines close before the broker's starts (tests/vllm_runs.py)."""
    require_vllm_host()
    engine = started("generate")
    llm, params = engine._llm, engine._sampling_params
    ids = [{"prompt_token_ids": p} for p in prompt_ids()]
    answers = Offline(
        greedy=llm.generate(ids, params(temperature=0.0, max_tokens=12), use_tqdm=False),
        counting=llm.generate(ids[2], params(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
        .outputs[0]
        .text,
        scored=llm.generate(
            ids[3], params(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False
        )[0].outputs[0],
        decode=llm.get_tokenizer().decode,
    )
    close_started()
    return answers


def prompt_ids() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_path()))
    return [tokenizer.encode(p).ids for p in PROMPTS]


def run_job(b: Broker, tmp_path: Path, job: str, lines: list[dict], timeout_s=600) -> dict:
    """Submits `lines` as `job`, waits for it, fetches it (each line once, as a result or an
    error line): custom_id -> its result line (the error lines: `errors`)."""
    assert (
        submit(b.config, write(tmp_path / f"{job}.jsonl", lines), "--job-id", job).returncode == 0
    )
    wait_for(lambda: finished(b, job), f"job {job} to finish", timeout_s=timeout_s)
    out = tmp_path / f"{job}.out.jsonl"
    assert fetch(b, job, out).returncode == 0
    assert_each_once(out, len(lines))
    return outputs(out)


def completion(ids: list[int], custom_id: str, **body) -> dict:
    return line(custom_id, "/v1/completions", model="gen", prompt_token_ids=ids, **body)


def test_greedy_lines_give_the_token_ids_of_vllm_offline_generate(offline, vllm_broker, tmp_path):
    ids = prompt_ids()
    lines = [
        completion(p, f"greedy-{i}", max_tokens=12, temperature=0, logprobs=0)
        for i, p in enumerate(ids)
    ]
    got = run_job(vllm_broker, tmp_path, "greedy", lines)
    decode = offline.decode
    for i, out in enumerate(offline.greedy):
        expected = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop":
            expected = expected[:-1]  # the EOS: the broker returns the tokens before it
        body = got[f"greedy-{i}"]["response"]["body"]
        choice = body["choices"][0]
        assert choice["token_ids"] == expected, i
        assert choice["text"] == decode(expected)
        assert choice["logprobs"]["tokens"] == [decode([t]) for t in expected]
        assert body["usage"]["completion_tokens"] == len(expected)
        assert body["usage"]["prompt_tokens"] == len(ids[i])


def test_n_seed_stop_strings_max_tokens_and_logprobs(offline, vllm_broker, tmp_path):
    ids = prompt_ids()
    sampled = {"temperature": 0.9, "seed": 7, "max_tokens": 10}
    lines = [
        completion(ids[1], "n3", n=3, **sampled),
        completion(ids[2], "stop", max_tokens=24, temperature=0, stop=[" 7"]),
        completion(ids[0], "short", max_tokens=3, temperature=0),
        completion(ids[3], "scored", max_tokens=6, temperature=0, logprobs=2),
    ]
    first = run_job(vllm_broker, tmp_path, "shapes-1", lines)
    again = run_job(vllm_broker, tmp_path, "shapes-2", lines[:1])
    choices = first["n3"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(len(c["text"]) > 0 for c in choices)
    assert len({c["text"] for c in choices}) > 1  # sampled: not three copies of one
    assert [c["text"] for c in choices] == [
        c["text"] for c in again["n3"]["response"]["body"]["choices"]
    ]  # a seed gives the same samples, job after job
    stopped = first["stop"]["response"]["body"]["choices"][0]
    greedy = offline.counting
    assert " 7" in greedy, greedy  # the counting prompt does reach the stop string
    assert stopped["text"] == greedy[: greedy.index(" 7")]
    assert stopped["finish_reason"] == "stop"
    short = first["short"]["response"]["body"]
    assert short["usage"]["completion_tokens"] == 3
    assert short["choices"][0]["finish_reason"] == "length"
    scored = first["scored"]["response"]["body"]["choices"][0]["logprobs"]
    reference = offline.scored
    steps = zip(reference.logprobs, reference.token_ids, strict=True)
    chosen = [step[t].logprob for step, t in steps]
    assert scored["token_logprobs"] == pytest.approx(
        chosen[: len(scored["token_logprobs"])], abs=0.05
    )
    assert all(len(top) == 2 for top in scored["top_logprobs"])


def test_an_item_past_the_context_or_the_vocabulary_fails_alone(vllm_broker, tmp_path):
    ids = prompt_ids()
    lines = [
        completion(ids[0], "fine", max_tokens=4, temperature=0),
        completion([42] * 8190, "too-long", max_tokens=4),  # SmolLM2's context: 8192 tokens
        completion([1, 49_152, 2], "past-vocab", max_tokens=4),  # its vocabulary: 49,152 ids
        completion(ids[1], "fine-too", max_tokens=4, temperature=0),
    ]
    got = run_job(vllm_broker, tmp_path, "bad-items", lines)
    assert got["fine"]["response"]["status_code"] == 200
    assert got["fine-too"]["response"]["status_code"] == 200
    failed = errors(tmp_path / "bad-items.out.jsonl")
    assert sorted(failed) == ["past-vocab", "too-long"]
    for bad, words in (("too-long", "context of 8192"), ("past-vocab", "vocabulary of 49152")):
        assert words in json.dumps(failed[bad]), failed[bad]  # the engine's own check


@pytest.mark.timeout(2 * START_S + 600)
def test_the_engine_process_killed_mid_job_every_line_ends_once(vllm_broker, tmp_path):
    served = vllm_broker
    ids = prompt_ids()
    lines = [completion(ids[i % 4], f"kill-{i}", max_tokens=24, temperature=0) for i in range(48)]
    job = "killed"
    assert (
        submit(served.config, write(tmp_path / f"{job}.jsonl", lines), "--job-id", job).returncode
        == 0
    )
    restarts = served.restarts().get("worker-0", 0)
    before = served.metric("fabric_items_completed_total")
    wait_for(
        lambda: served.metric("fabric_items_completed_total") > before,
        "results of this job before the kill",
        timeout_s=START_S,
    )
    for pid in engine_processes(served):
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: served.restarts().get("worker-0", 0) > restarts,
        "the supervisor to start the worker again",
        timeout_s=300,
    )
    wait_for(lambda: finished(served, job), "the job to finish", timeout_s=START_S + 300)
    out = tmp_path / f"{job}.out.jsonl"
    assert fetch(served, job, out).returncode == 0
    assert_each_once(out, len(lines))
    assert all(r["response"]["status_code"] == 200 for r in outputs(out).values())
    assert served.metric("fabric_dead_letters_total") == 0


@pytest.mark.parametrize("case", ["missing-model", "memory-refused"])
def test_an_engine_that_cannot_start_stops_the_batch_with_its_own_message(case, tmp_path):
    """`run.py batch` stops with the engine's message; for the memory share vLLM's CPU
    backend refuses, `status` on a broker of that config names it too (tests/test_oneshot.py
    checks the same for a missing model directory on the transformers engine)."""
    from test_oneshot import (
        assert_batch_stops_on_the_engine,
        assert_status_names_the_engine,
        broken_engine_config,
    )

    require_vllm_host()
    if case == "missing-model":
        missing = tmp_path / "no-such-model"
        options, words = f'model = "{missing}"', str(missing)
    else:  # on the CPU build: nearly all the host's RAM, which vLLM refuses at start
        from gpu.engines.vllm import on_cpu

        if not on_cpu():
            pytest.skip("vLLM runs on a GPU here: 0.99 of it may well be free")
        model = write_smollm2_dir(smollm2_cache_dir())
        options = f'model = "{model}", gpu_memory_utilization = 0.99'
        words = "gpu_memory_utilization = 0.99 reserves"
    config = broken_engine_config(tmp_path, "vllm", options)
    assert_batch_stops_on_the_engine(config, tmp_path, words, START_S)
    if case == "memory-refused":
        assert_status_names_the_engine(config, words, timeout_s=START_S)
