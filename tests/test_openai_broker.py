"""`engine = "openai"` through a real broker and `run.py worker`: a loopback OpenAI-compatible
server (tests/openai_fakes.py) behind a fault-injecting proxy.

Every line comes back once, with the server's text and usage, through 429 storms with
Retry-After, 500s, stalls past the timeout, connections dropped mid-answer and an upstream
down past `retry_for_s` (its batches go back to dispatch without an attempt and finish once
it returns: nothing dead-lettered); a 400 is that line's error line with the server's
message; the engine's concurrency (`fabric_worker_engine_concurrency`) halves under 429s and
under answers slower than `latency_target_ms`, and grows back. Each test ends with a clean
`check` of the data dir.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import openai.types
import pytest
from broker import REPO, Broker, submit, write_config
from conftest import assert_check_clean, wait_for
from openai_fakes import EXTRA_PROMPT_TOKENS, REFUSED_MESSAGE, FakeOpenAI, FaultProxy
from test_dispatch_pipeline import assert_each_once, fetch, finished
from test_fanout import errors, line, outputs, write

from pipeline.core import exitcodes

UP_MODEL = """
[[models]]
name = "up"
engine = "openai"
tokenizer = "{tokenizer}"
max_tokens = 64
"""  # every endpoint: whatever the server behind it serves


@contextlib.contextmanager
def openai_broker(tmp_path: Path, latency_s: float = 0.0, **options):
    """A broker with model `up`, a loopback server behind a proxy, and one `run.py worker
    --engine openai` talking to the proxy with `options`; yields (broker, server, proxy)."""
    config = write_config(tmp_path, workers=0)
    tokenizer = tmp_path / "tokenizer.json"
    config.write_text(config.read_text() + UP_MODEL.format(tokenizer=tokenizer))
    options = {"retry_for_s": 1.5, "timeout_s": 0.5, "max_concurrency": 16} | options
    with FakeOpenAI(tokenizer, latency_s) as server, FaultProxy(server) as proxy:
        b = Broker(config).start()
        flags = [f"--option={k}={v}" for k, v in options.items()]
        log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed once the child has it)
        worker = subprocess.Popen(
            b.worker_argv(
                "up",
                "openai",
                f"--option=base_url={proxy.base_url}",
                "--option=model=fake-upstream",
                f"--option=tokenizer={tokenizer}",
                *flags,
                batch_items=64,
            ),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        try:
            yield b, server, proxy
            worker.terminate()
            assert worker.wait(timeout=60) == exitcodes.OK
            assert b.stop() == exitcodes.OK, b.stderr
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=30)
            b.close()
    assert_check_clean(b.data_dir)


def prompts(n: int) -> list[str]:
    return [f"w{i % 900 + 1} w{i % 700 + 2} w{i % 500 + 3}" for i in range(n)]


def job_lines(texts: list[str]) -> list[dict]:
    lines = []
    for i, text in enumerate(texts):
        if i % 3 == 0:
            messages = [{"role": "user", "content": text}]
            lines.append(line(f"c{i}", "/v1/chat/completions", model="up", messages=messages))
        else:
            lines.append(line(f"c{i}", "/v1/completions", model="up", prompt=text, max_tokens=8))
    return lines


def submit_job(b: Broker, tmp_path: Path, job: str, lines: list[dict]) -> None:
    result = submit(b.config, write(tmp_path / f"{job}.jsonl", lines), "--job-id", job)
    assert result.returncode == 0, result.stderr


def fetched(b: Broker, tmp_path: Path, job: str, timeout_s: float) -> Path:
    wait_for(lambda: finished(b, job), f"job {job} to finish", timeout_s=timeout_s)
    out = tmp_path / f"{job}.out.jsonl"
    assert fetch(b, job, out).returncode == 0
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_line_once_through_faults_and_an_upstream_down_for_long(tmp_path):
    texts = prompts(240)
    lines = job_lines(texts)
    lines.append(line("refused", "/v1/completions", model="up", prompt="w1 w999", max_tokens=8))
    with openai_broker(tmp_path, latency_s=0.01) as (b, _server, proxy):
        proxy.mode = "down"  # longer than retry_for_s: batches go back to dispatch
        submit_job(b, tmp_path, "faults", lines)
        wait_for(
            lambda: b.metric("fabric_items_reclaimed_total", cause="handed_back") >= 64,
            "the worker to hand a batch back while the server is down",
            timeout_s=60,
        )
        proxy.script.extend(["429"] * 30 + ["500"] * 10 + ["stall"] * 3 + ["drop"] * 5)
        proxy.mode = "pass"
        out = fetched(b, tmp_path, "faults", timeout_s=120)
        assert_each_once(out, len(lines))  # the refused line's is in the errors file
        assert b.metric("fabric_dead_letters_total") == 0
        assert b.metric("fabric_worker_upstream_retries_total", model="up") >= 48
        assert min(proxy.counts[a] for a in ("down", "429", "500", "stall", "drop")) >= 3
    got = outputs(out)
    for i, text in enumerate(texts):
        record = got[f"c{i}"]
        body = record["response"]["body"]
        if i % 3 == 0:  # the server's text: the templated prompt's words reversed
            reply = openai.types.chat.ChatCompletion.model_validate(body)
            assert " ".join(reversed(text.split())) in reply.choices[0].message.content
        else:
            reply = openai.types.Completion.model_validate(body)
            assert reply.choices[0].text == " ".join(reversed(text.split()))
            assert reply.usage.prompt_tokens == 3 + EXTRA_PROMPT_TOKENS  # the server's usage
    [refused] = errors(out).values()
    assert REFUSED_MESSAGE in str(refused)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_concurrency_halves_under_429s_and_slow_answers_and_grows_back(tmp_path):
    """AIMD, read from the broker's metrics: it grows while the server answers well, halves
    under a 429 storm and under answers past latency_target_ms, and grows back each time."""
    options = {"start_concurrency": 2, "latency_target_ms": 400, "retry_for_s": 5}
    with openai_broker(tmp_path, latency_s=0.1, **options) as (b, server, proxy):
        texts = prompts(2500)
        submit_job(b, tmp_path, "aimd", job_lines(texts))

        def concurrency() -> float:
            return b.metric("fabric_worker_engine_concurrency", model="up")

        wait_for(lambda: concurrency() >= 8, "concurrency to grow to 8", timeout_s=60)
        proxy.retry_after = "0.05"
        proxy.mode = "429"  # a storm: every request refused
        wait_for(lambda: 0 < concurrency() <= 2, "concurrency to halve to 2", timeout_s=30)
        proxy.mode = "pass"
        wait_for(lambda: concurrency() >= 8, "concurrency to grow back to 8", timeout_s=60)
        server.latency_s = 0.6  # interactive traffic: answers slower than the 400 ms target
        began = time.monotonic()
        wait_for(lambda: 0 < concurrency() <= 2, "concurrency to fall under slow answers", 30)
        backed_off_s = time.monotonic() - began
        server.latency_s = 0.02
        wait_for(lambda: concurrency() >= 6, "concurrency to grow back again", timeout_s=60)
        assert proxy.most_in_flight >= 8
        out = fetched(b, tmp_path, "aimd", timeout_s=180)
        assert_each_once(out, len(texts))
        assert b.metric("fabric_dead_letters_total") == 0
    assert backed_off_s < 20  # batch work yields within seconds
