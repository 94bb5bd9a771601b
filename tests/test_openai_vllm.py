"""`engine = "openai"` against a real third-party server: vLLM's own OpenAI server (its CPU
build) serving SmolLM2 on loopback, with the fault-injecting proxy of tests/openai_fakes.py
between the worker and the server.

Runs where vLLM is importable in this Python (the README's test command installs its CPU build)
or `FABRIC_VLLM_PYTHON` names a Python that has it; skipped with the reason otherwise (failed
instead in CI: tests/vllm_runs.py `require_vllm_host`). One server for the module (a start
costs half a minute of CPU on 2 cores, eager), started after the other real vLLM runs have
closed their engines (tests/vllm_runs.py), and one broker with one `run.py worker --engine
openai` whose `base_url` is the proxy's.

| test | proves |
|------|--------|
| direct | chat and completions lines all come back once, with the text vLLM gives when asked directly and its `usage.prompt_tokens`, in bodies the `openai` package's types accept |
| faults | 429s (with Retry-After), 500s, stalls and answers cut mid-body from the proxy: every line once, with vLLM's own text, nothing dead-lettered; under a 429 storm the worker's concurrency halves to 2 or less, and grows back once the storm ends |
| killed | vLLM killed with SIGKILL mid-job (its whole process group) and started again: every line once, nothing dead-lettered |
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai.types
import pytest
from broker import REPO, Broker, free_port, submit, write_config
from conftest import assert_check_clean, wait_for
from openai_fakes import FaultProxy
from test_dispatch_pipeline import assert_each_once, fetch, finished
from test_fanout import line, outputs, write
from vllm_runs import VLLM_MARKS, close_all, require_vllm_host

from gpu.engines.smollm2_dir import smollm2_cache_dir, write_smollm2_dir
from gpu.engines.transformers import smollm2_tokenizer_path
from pipeline.core import exitcodes

HERE = sys.executable if importlib.util.find_spec("vllm") else ""
VLLM_PYTHON = os.environ.get("FABRIC_VLLM_PYTHON") or HERE
START_S = 600  # a server start on a loaded 2-core host
pytestmark = [pytest.mark.slow, *VLLM_MARKS]

SMOL_OPENAI = """
[[models]]
name = "smol"
engine = "openai"
tokenizer = "{tokenizer}"
max_tokens = 512
"""


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a loopback port, in its own group."""

    def __init__(self, model: Path, log: Path) -> None:
        self.model, self.log, self.port = model, log, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [
                    VLLM_PYTHON,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(self.model),
                    "--served-model-name",
                    "smol",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--gpu-memory-utilization",
                    "0.1",
                    "--max-model-len",
                    "2048",
                    "--dtype",
                    "float32",
                    "--enforce-eager",  # no graph compilation: about a minute less per start
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self.ready, "vLLM to serve", timeout_s=START_S, interval_s=2.0)
        return self

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"vLLM exited: {self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """SIGKILL to the server and its engine processes (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """vLLM's server (the other real vLLM runs' engines closed first: tests/vllm_runs.py), the
    proxy in front of it, a broker with model `smol` on the openai engine, and one worker
    sending to the proxy; yields (broker, server, proxy). At the end the worker and the broker
    stop cleanly and the data dir checks clean."""
    if not (VLLM_PYTHON and Path(VLLM_PYTHON).is_file()):
        require_vllm_host()  # skips (or in CI fails) with the reason
    close_all()
    tmp = tmp_path_factory.mktemp("openai-vllm")
    server = VllmServer(write_smollm2_dir(smollm2_cache_dir()), tmp / "vllm.log")
    tokenizer = smollm2_tokenizer_path()
    config = write_config(tmp, workers=0)
    config.write_text(config.read_text() + SMOL_OPENAI.format(tokenizer=tokenizer))
    try:
        with FaultProxy(server.start()) as proxy:
            proxy.upstream_timeout_s = 300.0  # vLLM on a loaded 2-core host: seconds an answer
            b = Broker(config).start()
            worker = subprocess.Popen(
                b.worker_argv(
                    "smol",
                    "openai",
                    f"--option=base_url={proxy.base_url}",
                    "--option=model=smol",
                    f"--option=tokenizer={tokenizer}",
                    "--option=retry_for_s=20.0",  # past it, a batch goes back to dispatch
                    "--option=timeout_s=120.0",
                    "--option=max_concurrency=8",
                ),
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                yield b, server, proxy
                worker.terminate()
                assert worker.wait(timeout=120) == exitcodes.OK
                assert b.stop() == exitcodes.OK, b.stderr
            finally:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait(timeout=30)
                b.close()
    finally:
        server.kill()
    assert_check_clean(b.data_dir)


PROMPTS = ["The capital of France is", "Once upon a time", "2 + 2 =", "The sea is"]


def job_lines(copies: int = 1) -> list[dict]:
    lines = []
    greedy = {"max_tokens": 16, "temperature": 0}
    for k in range(copies):
        for i, prompt in enumerate(PROMPTS):
            chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
            chat["temperature"] = 0  # greedy, as asked directly (OpenAI's default samples)
            lines.append(line(f"chat-{k}-{i}", "/v1/chat/completions", model="smol", **chat))
            lines.append(
                line(f"text-{k}-{i}", "/v1/completions", model="smol", prompt=prompt, **greedy)
            )
    return lines


@functools.cache
def direct(server: VllmServer) -> dict[str, dict]:
    """vLLM's own answers, asked directly (not through the proxy): `chat-i` and `text-i`."""
    answers = {}
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        answers[f"chat-{i}"] = server.post(
            "/chat/completions",
            {"model": "smol", "messages": messages, "max_tokens": 16, "temperature": 0},
        )
        answers[f"text-{i}"] = server.post(
            "/completions", {"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        )
    return answers


def run_job(b: Broker, tmp_path: Path, job: str, lines: list[dict]) -> Path:
    assert (
        submit(b.config, write(tmp_path / f"{job}.jsonl", lines), "--job-id", job).returncode == 0
    )
    return tmp_path / f"{job}.out.jsonl"


def assert_as_vllm_answers(out: Path, lines: list[dict], server: VllmServer) -> None:
    """Each line once, every one a result with vLLM's own text (and prompt tokens), in a body
    the openai package's type for its url accepts."""
    assert_each_once(out, len(lines))
    answers = direct(server)
    for custom_id, got in outputs(out).items():
        kind, _, i = custom_id.split("-")
        body, asked = got["response"]["body"], answers[f"{kind}-{i}"]
        if kind == "chat":
            chat = openai.types.chat.ChatCompletion.model_validate(body)
            assert chat.choices[0].message.content == asked["choices"][0]["message"]["content"]
        else:
            text = openai.types.Completion.model_validate(body)
            assert text.choices[0].text == asked["choices"][0]["text"], custom_id
            assert text.usage.prompt_tokens == asked["usage"]["prompt_tokens"]


def test_chat_and_completions_lines_give_what_vllm_gives_directly(tmp_path, upstream):
    b, server, proxy = upstream
    lines = job_lines()
    out = run_job(b, tmp_path, "direct", lines)
    wait_for(lambda: finished(b, "direct"), "the job to finish", timeout_s=600)
    assert fetch(b, "direct", out).returncode == 0
    assert_as_vllm_answers(out, lines, server)
    assert set(proxy.counts) == {"pass"}


def test_faults_between_worker_and_vllm_lose_and_double_nothing_and_concurrency_backs_off(
    tmp_path, upstream
):
    b, server, proxy = upstream

    def concurrency() -> float:
        return b.metric("fabric_worker_engine_concurrency", model="smol")

    retries = b.metric("fabric_worker_upstream_retries_total", model="smol")
    handed_back = b.metric("fabric_items_reclaimed_total", cause="handed_back")
    proxy.script.extend(["429"] * 6 + ["500"] * 4 + ["stall"] * 2 + ["drop"] * 3)
    lines = job_lines(copies=3)
    out = run_job(b, tmp_path, "faults", lines)
    wait_for(lambda: finished(b, "faults"), "the job to finish", timeout_s=600)
    assert fetch(b, "faults", out).returncode == 0
    assert_as_vllm_answers(out, lines, server)
    assert all(proxy.counts[a] >= n for a, n in (("429", 6), ("500", 4), ("stall", 2), ("drop", 3)))
    # each fault is a request sent again, unless its batch went back to dispatch meanwhile
    # (vLLM slower than retry_for_s on a loaded host): then its items were sent again
    again = b.metric("fabric_worker_upstream_retries_total", model="smol") - retries
    again += b.metric("fabric_items_reclaimed_total", cause="handed_back") - handed_back
    assert again >= 15

    lines = job_lines(copies=12)  # long enough to watch the limit move
    out = run_job(b, tmp_path, "storm", lines)
    wait_for(lambda: concurrency() >= 5, "concurrency to grow past its start", timeout_s=300)
    proxy.mode = "429"  # a storm: every request refused
    wait_for(lambda: 0 < concurrency() <= 2, "concurrency to halve to 2 or less", timeout_s=60)
    proxy.mode = "pass"
    wait_for(lambda: concurrency() >= 4, "concurrency to grow back", timeout_s=300)
    wait_for(lambda: finished(b, "storm"), "the job to finish", timeout_s=600)
    assert fetch(b, "storm", out).returncode == 0
    assert_as_vllm_answers(out, lines, server)
    assert b.metric("fabric_dead_letters_total") == 0


@pytest.mark.timeout(2 * START_S + 600)
def test_vllm_killed_mid_job_and_started_again_every_line_once(tmp_path, upstream):
    b, server, _ = upstream
    lines = job_lines(copies=6)
    out = run_job(b, tmp_path, "killed", lines)
    done = b.metric("fabric_items_completed_total")
    wait_for(
        lambda: b.metric("fabric_items_completed_total") >= done + 8,
        "some results before the kill",
        timeout_s=600,
    )
    server.kill()
    wait_for(
        lambda: b.metric("fabric_items_reclaimed_total", cause="handed_back") >= 1,
        "a batch handed back while vLLM is down",
        timeout_s=120,
    )
    server.start()
    wait_for(lambda: finished(b, "killed"), "the job to finish", timeout_s=900)
    assert fetch(b, "killed", out).returncode == 0
    assert_as_vllm_answers(out, lines, server)
    assert b.metric("fabric_dead_letters_total") == 0
