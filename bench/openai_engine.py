"""`engine = "openai"` against a real vLLM server driven directly by an async client.

    python bench/openai_engine.py [--prompts 200] [--max-tokens 16] [--concurrency 16]
                                  [--pairs 3] [--no-docs]

In one run, with vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
its CPU build here) serving SmolLM2 on loopback, the same prompts and sampling both ways:

A. the server alone, driven by an async client in this process (`httpx.AsyncClient`, one
   connection per request in flight, at most `--concurrency` in flight): one
   `POST /v1/completions` per prompt, `"prompt": [token ids]`, temperature 0, top_p 1,
   `max_tokens` M (the body the `openai` engine sends);
B. the pipeline: a private broker whose one worker has `engine = "openai"` with
   `options = {base_url, model, max_concurrency = C, start_concurrency = C}` (the same
   concurrency from the first request: AIMD only moves it down if the server pushes back)
   and the default batch settings; the prompts submitted as `/v1/completions` lines
   (`prompt_token_ids`) and every result fetched as `run.py results --follow` does, timed
   from the first submitted line to the last result written.

A and B alternate (A, B, A, B ...), both warmed up first; the figure held to the target is
the median of the per-pair ratios B / A of items/s: target >= 95%. Beside it, CPU seconds per
request: the worker process's own (user + system, from /proc via psutil), the broker's other
processes', and the async client's (this process over A). Writes its section of
docs/BENCHMARKS.md unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import command_line, describe, load_average  # noqa: E402
from bench.report import Row, render_section, write_section  # noqa: E402
from bench.vllm_common import (  # noqa: E402
    DOC,
    MODEL,
    START_TIMEOUT_S,
    JobBroker,
    model_dir,
    prompts,
    ratio_rows,
    tokenizer_path,
)
from bench.vllm_engine import vllm_version  # noqa: E402

TARGET = 95.0  # % of the async client's items/s
WARM_PROMPTS = 32


class Server:
    """vLLM's OpenAI server on a free loopback port, in its own process group."""

    def __init__(self, directory: Path, log: Path) -> None:
        from gpu.engines.vllm import on_cpu, with_backend_defaults
        from pipeline.transport.ports import free_loopback_ports

        self.port = free_loopback_ports(1)[0]
        share = with_backend_defaults({}, on_cpu())["gpu_memory_utilization"]
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(directory),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--gpu-memory-utilization",
            str(share),
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Server:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not start; see {self.log}")
            time.sleep(2.0)  # it compiles its graphs: minutes
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its engine process
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def body(ids: list[int], max_tokens: int) -> dict:
    """The body the `openai` engine sends for a greedy item (gpu/engines/openai.py `_body`)."""
    return {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
    }


def client_alone(
    base_url: str, ids: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[float, float, list[str]]:
    """Seconds and this process's CPU seconds for every prompt sent by an async client with
    at most `concurrency` requests in flight; each prompt's text."""
    import httpx

    texts: list[str] = [""] * len(ids)

    async def drive() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600.0) as client:
            queue = iter(range(len(ids)))

            async def one_lane() -> None:
                for i in queue:  # each lane takes the next prompt when its answer is in
                    answer = await client.post("/completions", json=body(ids[i], max_tokens))
                    answer.raise_for_status()
                    texts[i] = answer.json()["choices"][0]["text"]

            await asyncio.gather(*(one_lane() for _ in range(concurrency)))

    cpu, began = time.process_time(), time.perf_counter()
    asyncio.run(drive())
    return time.perf_counter() - began, time.process_time() - cpu, texts


def broker_cpu_s(b: JobBroker) -> float:
    """CPU seconds the broker's processes (supervisor and stages, not the worker) spent."""
    import psutil

    total = 0.0
    for process in [psutil.Process(b.broker.pid), *psutil.Process(b.broker.pid).children(True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts per run (200)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (16)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    parser.add_argument("--pairs", type=int, default=3, help="A, B pairs (3)")
    parser.add_argument("--dir", default=str(REPO / "var" / "bench-openai-engine"))
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args()
    started = time.monotonic()
    bench_dir = Path(args.dir)
    shutil.rmtree(bench_dir, ignore_errors=True)
    bench_dir.mkdir(parents=True)
    facts = describe(bench_dir)
    ids = prompts(args.prompts)
    c = args.concurrency
    model = {
        "name": MODEL,
        "engine": "openai",
        "tokenizer": str(tokenizer_path()),
        "max_tokens": 2048,
    }
    alone, piped, same = [], [], []
    cpu: dict[str, list[float]] = {}
    fed: dict[str, list[float]] = {}
    with Server(model_dir(), bench_dir / "vllm.log") as server:
        options = {
            "base_url": server.base_url,
            "model": MODEL,
            "max_concurrency": c,
            "start_concurrency": c,
        }
        with JobBroker(bench_dir, model, {"model": MODEL, "options": options}) as b:
            # every prompt once first: the server's prefix cache then holds them for A and B
            client_alone(server.base_url, ids, args.max_tokens, c)
            b.run_job(ids[:WARM_PROMPTS], args.max_tokens, "warm-up")
            for pair in range(args.pairs):
                seconds, client_cpu, reference = client_alone(
                    server.base_url, ids, args.max_tokens, c
                )
                alone.append(len(ids) / seconds)
                worker_before, broker_before = b.worker_cpu_s(), broker_cpu_s(b)
                since = time.time()
                seconds, got = b.run_job(ids, args.max_tokens, f"pair-{pair}")
                piped.append(len(ids) / seconds)
                n = len(ids)
                for name, value in (
                    ("worker process (engine openai)", (b.worker_cpu_s() - worker_before) / n),
                    ("broker's other processes", (broker_cpu_s(b) - broker_before) / n),
                    ("async client (httpx), this process", client_cpu / n),
                ):
                    cpu.setdefault(name, []).append(1000 * value)
                same.append(
                    sum(1 for x, y in zip(reference, got, strict=True) if y and x == y["text"])
                )
                batches = b.batches(since)
                engine_s = float(batches["seconds"].sum())
                for name, value in (
                    ("batches", len(batches)),
                    ("items per batch", float(batches["items"].mean())),
                    ("engine busy, % of the pipeline's wall", 100 * engine_s / seconds),
                ):
                    fed.setdefault(name, []).append(value)
                print(
                    f"pair {pair}: client {alone[-1]:.2f} items/s, pipeline {piped[-1]:.2f} "
                    f"items/s ({100 * piped[-1] / alone[-1]:.1f}%), {len(batches)} batches, "
                    f"same text {same[-1]}/{n}; CPU ms/request: "
                    + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items()),
                    file=sys.stderr,
                )
    rows = ratio_rows(
        "1 throughput",
        f"async client, {c} in flight",
        "pipeline (engine openai)",
        alone,
        piped,
        TARGET,
    )
    rows += [Row("2 CPU per request", f"{name}, ms", tuple(v)) for name, v in cpu.items()]
    rows += [Row("3 the worker's engine", name, tuple(v)) for name, v in fed.items()]
    rows.append(Row("4 outputs", "prompts with the same text both ways", tuple(same)))
    facts["load average at end"] = load_average()
    facts["vllm"] = vllm_version()
    facts["server"] = " ".join(Path(a).name if a == sys.executable else a for a in server.argv)
    notes = [
        f"Prompts: {len(ids)} token-id prompts (SmolLM2's tokenizer over the demo corpus, each "
        f"cut to 16-48 tokens), `max_tokens` {args.max_tokens}, temperature 0; {c} requests "
        f"in flight both ways; {args.pairs} pairs, each the async client then the pipeline, "
        "back to back, against the same server, after the client sent every prompt once (so "
        "vLLM's prefix cache holds them for both sides).",
        "A: `httpx.AsyncClient` in this process, one coroutine per request in flight, each "
        "sending the next prompt when its answer is in (keep-alive connections); the body "
        "is the one the `openai` engine sends. B: a private broker (default lanes and batch "
        "settings) and one worker (`[workers] model = smol`, engine openai, `max_concurrency` "
        f"= `start_concurrency` = {c}), started by the bench as bench/batch_log_worker.py so "
        "that each batch its engine ran is recorded (row 3).",
        "Row 2: CPU seconds (user + system) over the timed run divided by the requests: the "
        "worker's process (its engine sends the requests and tokenises the answers' text), "
        "the broker's supervisor and stages (ingest, dispatch, completion), and the async "
        "client's process over A (it sends and parses only). vLLM's own CPU is the same "
        "both ways and not counted.",
    ]
    body_text = render_section(
        "The openai engine against an async client (bench/openai_engine.py)",
        '`engine = "openai"` in the pipeline against vLLM\'s own OpenAI server driven '
        "directly by an async client at the same concurrency, the same prompts and sampling, "
        "in interleaved pairs against one server.",
        command_line(),
        time.monotonic() - started,
        facts,
        rows,
        notes,
    )
    print(body_text)
    if not args.no_docs:
        write_section(DOC, "bench/openai_engine.py", body_text)
    shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
