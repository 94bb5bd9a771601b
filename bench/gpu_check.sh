#!/usr/bin/env bash
# A short job end to end through the broker on the vllm engine: tokens/s and GPU idle fraction.
#
#     bash bench/gpu_check.sh
#
# Needs a machine with an NVIDIA GPU (nvidia-smi) and vLLM installed in the
# Python it runs ($PYTHON, default .venv/bin/python, else python3); it stops
# at once, saying which is missing, otherwise. It writes its own config under
# var/gpu_check/ (an empty data dir each run, loopback ports picked free,
# `[workers] local = 1` on the vllm engine), starts the broker, waits until
# the worker has loaded the model and registered, submits ITEMS completions
# of token-id prompts (random ids, 16..LONGEST tokens, temperature 0), fetches
# the results, stops the broker, and prints one table: items, prompt and
# generated tokens, seconds from the first submitted line to the last result
# written, generated tokens/s, and the GPU's idle fraction over that time
# (`nvidia-smi --query-gpu=utilization.gpu` sampled every 100 ms; a sample
# of 0% is idle).
#
# Settings (environment):
#   FABRIC_VLLM_MODEL   model path or Hugging Face id (default Qwen/Qwen2.5-0.5B-Instruct)
#   ITEMS               prompts in the job (default 2000)
#   MAX_TOKENS          tokens to generate per prompt (default 128)
#   LONGEST             longest prompt in tokens (default 512)
#   GPU_INDEX           which GPU nvidia-smi samples (default 0)
#   WORKER_BATCH_ITEMS  items per batch the worker asks for (default 512)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $*" >&2; exit 2; }

PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export FABRIC_VLLM_MODEL="${FABRIC_VLLM_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
export ITEMS="${ITEMS:-2000}" MAX_TOKENS="${MAX_TOKENS:-128}" LONGEST="${LONGEST:-512}"
export GPU_INDEX="${GPU_INDEX:-0}" WORKER_BATCH_ITEMS="${WORKER_BATCH_ITEMS:-512}"

command -v nvidia-smi >/dev/null ||
    fail "no GPU: nvidia-smi is not on PATH; run this on a host with an NVIDIA GPU and its driver"
GPU_NAME="$(nvidia-smi -i "$GPU_INDEX" --query-gpu=name,memory.total --format=csv,noheader 2>&1)" ||
    fail "no GPU: nvidia-smi -i $GPU_INDEX says: $GPU_NAME"
VLLM_VERSION="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" ||
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

from collector.client import DispatchClient, ResultsClient  # noqa: E402
from config import load_settings  # noqa: E402
from ingest.sdk import Producer  # noqa: E402

env = os.environ
ITEMS, MAX_TOKENS, LONGEST = int(env["ITEMS"]), int(env["MAX_TOKENS"]), int(env["LONGEST"])
MODEL, GPU = env["FABRIC_VLLM_MODEL"], env["GPU_INDEX"]
LOAD_DEADLINE_S = 900.0  # a first start may fetch and compile the model
ROOT = REPO / "var" / "gpu_check"


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def write_inputs(root):
    import random

    rng = random.Random(7)
    lanes = [64, 128, 256, 512, 1024, 2048]
    lanes = [lane for lane in lanes if lane < LONGEST] + [LONGEST]
    ports = free_ports(4)
    data = root / "data"
    shutil.rmtree(data, ignore_errors=True)  # each run starts from an empty broker
    config = root / "gpu_check.toml"
    config.write_text(
        f"""# Written by bench/gpu_check.sh; rewritten on every run.
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
[workers]
local = 1
engine = "vllm"
batch_items = {int(env["WORKER_BATCH_ITEMS"])}
batch_tokens = 1048576
prefetch = 2
target_batch_s = 0.0
[[models]]
name = "gen"
engine = "vllm"
tokenizer = ""
max_tokens = {LONGEST}
endpoints = ["/v1/completions"]
"""
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


def wait_for_worker(settings, broker):
    deadline = time.monotonic() + LOAD_DEADLINE_S
    with DispatchClient(settings.dispatch.bind, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if broker.poll() is not None:
                sys.exit(f"gpu_check: the broker exited ({broker.returncode}); see {ROOT}/broker.err")
            try:
                if client.broker_status().get("workers"):
                    return
            except Exception:  # not up yet
                pass
            time.sleep(1.0)
    sys.exit(f"gpu_check: no worker registered within {LOAD_DEADLINE_S:.0f} s; see {ROOT}/broker.err")


def main():
    ROOT.mkdir(parents=True, exist_ok=True)
    config, jsonl = write_inputs(ROOT)
    settings = load_settings(config)
    print(f"gpu_check: starting the broker with one vllm worker on {MODEL} ...", file=sys.stderr)
    with open(ROOT / "broker.err", "w") as err:
        broker = subprocess.Popen(
            [sys.executable, "run.py", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        wait_for_worker(settings, broker)
        sampler = Sampler()
        started = time.monotonic()
        job = f"gpu-check-{time.strftime('%H%M%S')}"
        with Producer(settings.ingest.bind, timeout_s=30.0, attempts=20) as producer:
            report = producer.submit_file(jsonl, job)
        if report.rejected:
            sys.exit(f"gpu_check: {report.rejected} lines rejected: {report.errors[:1]}")
        out = ROOT / "results.jsonl"
        out.unlink(missing_ok=True)
        with ResultsClient(settings.completion.bind, timeout_s=30.0) as client:
            fetched = client.fetch(job, str(out), str(ROOT / "errors.jsonl"), follow=True)
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
        sys.exit(f"gpu_check: {fetched.errors} error results; see {ROOT}/errors.jsonl")


main()
PY
