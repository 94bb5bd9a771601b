#!/usr/bin/env bash
# A short job end to end through the broker on vLLM, in both of its modes: tokens/s and GPU
# idle fraction.
#
#     bash bench/gpu_check.sh
#
# Needs a machine with an NVIDIA GPU (nvidia-smi) and vLLM installed in the
# Python it runs ($PYTHON, default .venv/bin/python, else python3); it stops
# at once, saying which is missing, otherwise. For each mode in MODES it writes
# its own config under var/gpu_check/ (an empty data dir each run, loopback ports
# picked free, one local worker), starts the broker, waits until the worker has
# registered, submits ITEMS completions of token-id prompts (random ids, 16..LONGEST
# tokens, temperature 0), fetches the results, stops the broker, and prints one table:
# items, prompt and generated tokens, seconds from the first submitted line to the
# last result written, generated tokens/s, and the GPU's idle fraction over that time
# (`nvidia-smi --query-gpu=utilization.gpu` sampled every 100 ms; a sample of 0% is
# idle). The modes:
#
#   vllm    the worker runs the `vllm` engine: vLLM's offline LLM in its own process
#   openai  vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server
#           --model MODEL`, what `vllm serve MODEL` starts) on a loopback port, and a worker
#           on the `openai` engine sending each item to it (docs/engines.md, `openai`);
#           the server starts after the first mode's broker has stopped, and is killed at
#           the end (its log: var/gpu_check/openai/vllm-server.log)
#
# Settings (environment):
#   FABRIC_VLLM_MODEL   model path or Hugging Face id (default Qwen/Qwen2.5-0.5B-Instruct)
#   MODES               which modes, in order (default "vllm openai")
#   ITEMS               prompts in the job (default 2000)
#   MAX_TOKENS          tokens to generate per prompt (default 128)
#   LONGEST             longest prompt in tokens (default 512)
#   GPU_INDEX           which GPU nvidia-smi samples (default 0)
#   WORKER_BATCH_ITEMS  items per batch the worker asks for (default 512)
#   OPENAI_CONCURRENCY  the openai worker's max_concurrency (default 256)
#   VLLM_SERVE_ARGS     more arguments for vLLM's server (e.g. "--max-model-len 4096")
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $*" >&2; exit 2; }

PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export FABRIC_VLLM_MODEL="${FABRIC_VLLM_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
export ITEMS="${ITEMS:-2000}" MAX_TOKENS="${MAX_TOKENS:-128}" LONGEST="${LONGEST:-512}"
export GPU_INDEX="${GPU_INDEX:-0}" WORKER_BATCH_ITEMS="${WORKER_BATCH_ITEMS:-512}"
export MODES="${MODES:-vllm openai}" OPENAI_CONCURRENCY="${OPENAI_CONCURRENCY:-256}"

command -v nvidia-smi >/dev/null ||
    fail "no GPU: nvidia-smi is not on PATH; run this on a host with an NVIDIA GPU and its driver"
GPU_NAME="$(nvidia-smi -i "$GPU_INDEX" --query-gpu=name,memory.total --format=csv,noheader 2>&1)" ||
    fail "no GPU: nvidia-smi -i $GPU_INDEX says: $GPU_NAME"
VLLM_VERSION="$("$PYTHON" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)" ||
    fail "no vllm: $PYTHON cannot find the vllm package; pip install vllm (GPU hosts), or set PYTHON"

export GPU_NAME VLLM_VERSION
exec "$PYTHON" - "$@" <<'PY'
"""The run itself (bench/gpu_check.sh holds the how and why)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path.cwd()
sys.path.insert(0, str(REPO))

from collector.results_client import DispatchClient, ResultsClient  # noqa: E402
from config import load_settings  # noqa: E402
from ingest.submit_client import Producer  # noqa: E402

env = os.environ
ITEMS, MAX_TOKENS, LONGEST = int(env["ITEMS"]), int(env["MAX_TOKENS"]), int(env["LONGEST"])
MODEL, GPU = env["FABRIC_VLLM_MODEL"], env["GPU_INDEX"]
LOAD_DEADLINE_S = 900.0  # a first start may fetch and compile the model
ROOT = REPO / "var" / "gpu_check"
MODES = env["MODES"].split()


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def tokenizer_of(model):
    """The model's tokenizer.json (the openai engine turns the server's text into ids with
    it): in a local directory, or fetched from the Hugging Face hub beside its config."""
    local = Path(model) / "tokenizer.json"
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download

    hf_hub_download(model, "tokenizer_config.json")  # its chat template, beside it
    return Path(hf_hub_download(model, "tokenizer.json"))


def worker_table(mode, server_url):
    """The `[[workers]]` table of `mode`: the vllm engine on MODEL, or the openai engine
    sending to the server at `server_url`."""
    table = f"""[[workers]]
model = "gen"
count = 1
batch_items = {int(env["WORKER_BATCH_ITEMS"])}
batch_tokens = 1048576
prefetch = 2
target_batch_s = 0.0
"""
    if mode == "vllm":
        return table + f"options = {{model = {json.dumps(MODEL)}}}\n"
    options = {
        "base_url": server_url,
        "model": MODEL,
        "tokenizer": str(tokenizer_of(MODEL)),
        "max_concurrency": int(env["OPENAI_CONCURRENCY"]),
    }
    shown = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    return table + f"options = {{{shown}}}\n"


def write_inputs(root, mode, server_url=None):
    import random

    rng = random.Random(7)
    lanes = [64, 128, 256, 512, 1024, 2048]
    lanes = [lane for lane in lanes if lane < LONGEST] + [LONGEST]
    ports = free_ports(4)
    data = root / "data"
    shutil.rmtree(data, ignore_errors=True)  # each run starts from an empty broker
    config = root / "gpu_check.toml"
    config.write_text(
        f"""# Written by bench/gpu_check.sh (mode {mode}); rewritten on every run.
[broker]
data_dir = "{data}"
lanes = {lanes}
[ingest]
bind = "tcp://127.0.0.1:{ports[0]}"
[dispatch]
bind = "tcp://127.0.0.1:{ports[1]}"
heartbeat_bind = "tcp://127.0.0.1:{ports[2]}"
reregister_grace_s = 1.0
[completion]
bind = "tcp://127.0.0.1:{ports[3]}"
[[models]]
name = "gen"
engine = "{mode}"
tokenizer = ""
max_tokens = {LONGEST}
endpoints = ["/v1/completions"]
{worker_table(mode, server_url)}"""
    )
    jsonl = root / "input.jsonl"
    with open(jsonl, "w") as out:
        for i in range(ITEMS):
            ids = [rng.randrange(100, 20_000) for _ in range(rng.randint(16, LONGEST))]
            body = {
                "model": "gen",
                "prompt_token_ids": ids,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            line = {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    return config, jsonl


class VllmServer:
    """vLLM's OpenAI server on MODEL, on a loopback port, in a process group of its own."""

    def __init__(self, root):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = root / "vllm-server.log"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            *env.get("VLLM_SERVE_ARGS", "").split(),
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self):
        import urllib.request

        deadline = time.monotonic() + LOAD_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"gpu_check: vLLM's server exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:  # not up yet
                pass
            time.sleep(1.0)
        sys.exit(f"gpu_check: vLLM's server not up within {LOAD_DEADLINE_S:.0f} s; see {self.log}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


class Sampler:
    """nvidia-smi utilization.gpu every 100 ms, with the time each sample came in."""

    def __init__(self):
        self.samples = []
        self.proc = subprocess.Popen(
            [
                "nvidia-smi", "-i", GPU, "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits", "-lms", "100",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append((time.monotonic(), int(line)))

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def between(self, start, end):
        return [u for t, u in self.samples if start <= t <= end]


def wait_for_worker(settings, broker, root):
    deadline = time.monotonic() + LOAD_DEADLINE_S
    with DispatchClient(settings.dispatch.bind, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if broker.poll() is not None:
                sys.exit(f"gpu_check: the broker exited ({broker.returncode}); see {root}/broker.err")
            try:
                if client.broker_status().get("workers"):
                    return
            except Exception:  # not up yet
                pass
            time.sleep(1.0)
    sys.exit(f"gpu_check: no worker registered within {LOAD_DEADLINE_S:.0f} s; see {root}/broker.err")


def run_mode(mode):
    """One mode's run (the header's steps); its table printed."""
    root = ROOT / mode
    root.mkdir(parents=True, exist_ok=True)
    server = VllmServer(root) if mode == "openai" else None
    try:
        if server is not None:
            print(f"gpu_check: starting vLLM's OpenAI server on {MODEL} ...", file=sys.stderr)
            server.wait_ready()
        run_broker(mode, root, server.url if server else None)
    finally:
        if server is not None:
            server.stop()


def run_broker(mode, root, server_url):
    config, jsonl = write_inputs(root, mode, server_url)
    settings = load_settings(config)
    print(f"gpu_check: starting the broker with one {mode} worker on {MODEL} ...", file=sys.stderr)
    with open(root / "broker.err", "w") as err:
        broker = subprocess.Popen(
            [sys.executable, "run.py", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        wait_for_worker(settings, broker, root)
        sampler = Sampler()
        started = time.monotonic()
        job = f"gpu-check-{time.strftime('%H%M%S')}"
        with Producer(settings.ingest.bind, timeout_s=30.0, attempts=20) as producer:
            report = producer.submit_file(jsonl, job)
        if report.rejected:
            sys.exit(f"gpu_check: {report.rejected} lines rejected: {report.errors[:1]}")
        out = root / "results.jsonl"
        out.unlink(missing_ok=True)
        with ResultsClient(settings.completion.bind, timeout_s=30.0) as client:
            fetched = client.fetch(job, str(out), str(root / "errors.jsonl"), follow=True)
        finished = time.monotonic()
        sampler.stop()
    finally:
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            broker.kill()
    prompt = generated = 0
    with open(out) as results:
        for line in results:
            usage = json.loads(line)["response"]["body"]["usage"]
            prompt += usage["prompt_tokens"]
            generated += usage["completion_tokens"]
    elapsed = finished - started
    utilization = sampler.between(started, finished)
    idle = sum(1 for u in utilization if u == 0) / max(1, len(utilization))
    mean = sum(utilization) / max(1, len(utilization))
    rows = [
        ("command", " ".join(["bash bench/gpu_check.sh", *sys.argv[1:]])),
        ("mode", mode if mode == "vllm" else "openai, against vLLM's OpenAI server"),
        ("gpu", env["GPU_NAME"]),
        ("vllm / model", f"{env['VLLM_VERSION']} / {MODEL}"),
        ("items (errors)", f"{fetched.written} ({fetched.errors})"),
        ("prompt tokens", f"{prompt}"),
        ("generated tokens", f"{generated} (max_tokens {MAX_TOKENS})"),
        ("submit to last result", f"{elapsed:.1f} s"),
        ("generated tokens/s", f"{generated / elapsed:,.0f}"),
        ("all tokens/s", f"{(prompt + generated) / elapsed:,.0f}"),
        ("GPU idle fraction", f"{idle:.1%} of {len(utilization)} samples (mean util {mean:.0f}%)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if fetched.errors or fetched.written != ITEMS:
        sys.exit(f"gpu_check: {fetched.errors} error results; see {root}/errors.jsonl")


def main():
    unknown = [m for m in MODES if m not in ("vllm", "openai")]
    if unknown:
        sys.exit(f"gpu_check: MODES = {env['MODES']!r}: {unknown} unknown; use vllm and/or openai")
    for mode in MODES:
        run_mode(mode)


main()
PY
