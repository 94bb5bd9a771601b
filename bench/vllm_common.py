"""What bench/vllm_engine.py and bench/openai_engine.py share: SmolLM2's directory, the
prompts, a private broker serving one model, a timed job through it, and the paired ratio.

| piece            | what it is                                                               |
|------------------|--------------------------------------------------------------------------|
| `model_dir()`    | SmolLM2 as vLLM loads it, written once from the pinned GGUF (gpu/engines/smollm2_dir.py) |
| `prompts(n)`     | n token-id prompts: the demo corpus (Python's documentation topics) through SmolLM2's tokenizer, each cut to 16-48 tokens (the i-th to 16 + 7i mod 33) |
| `JobBroker`      | `run.py --config` as a child, with one `[workers]` group; `run_job` submits the prompts as `/v1/completions` lines (`prompt_token_ids`, temperature 0, fixed `max_tokens`) and fetches every result as `run.py results` does (text decoded), timed from the first submitted line to the last result written |
| `ratio_rows`     | the paired figures as report rows: each side's items/s and the per-pair ratio |

Timings on a shared host drift from minute to minute, so each figure is a ratio of two runs
made back to back (A, B, A, B ...), and the median of those ratios is the one held to a target.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import Row  # noqa: E402

DOC = REPO / "docs" / "BENCHMARKS.md"
MODEL = "smol"  # the model's name in the broker (and the served name of vLLM's server)
SHORTEST, SPREAD = 16, 33  # prompt i has SHORTEST + (7 i mod SPREAD) tokens
START_TIMEOUT_S = 900.0  # a vLLM start compiles its graphs: minutes on 2 busy cores
# vLLM (here, in the worker and in its server: they inherit it) logs its errors only, so that
# the table stands out; a start that fails still says why
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def model_dir() -> Path:
    from gpu.engines.smollm2_dir import smollm2_cache_dir, write_smollm2_dir

    return write_smollm2_dir(smollm2_cache_dir())


def tokenizer_path() -> Path:
    from gpu.engines.transformers import smollm2_tokenizer_path

    return smollm2_tokenizer_path()


def prompts(count: int) -> list[list[int]]:
    """`count` token-id prompts (the module docstring); the corpus repeats past its end."""
    from tokenizers import Tokenizer

    from cli.demo import corpus

    texts = corpus()
    tokenizer = Tokenizer.from_file(str(tokenizer_path()))
    ids = [e.ids for e in tokenizer.encode_batch(texts[: min(count, len(texts))])]
    return [ids[i % len(ids)][: SHORTEST + (7 * i) % SPREAD] for i in range(count)]


def write_job(path: Path, ids: list[list[int]], max_tokens: int) -> Path:
    with open(path, "w") as out:
        for i, prompt in enumerate(ids):
            body = {
                "model": MODEL,
                "prompt_token_ids": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            line = {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    return path


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


class JobBroker:
    """A private broker on `root` serving `model` (a [[models]] table) to one worker: the
    [workers] table `workers` (with `options`), started by the bench as
    bench/batch_log_worker.py (its pid known, each of its batches logged; the broker runs with
    `local = 0`), with the options the supervisor would give it."""

    def __init__(self, root: Path, model: dict, workers: dict) -> None:
        from assembly.private_broker import write_config
        from config import load_settings

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        more = {
            "broker": {"segment_bytes": 16 << 20},
            "ingest": {"chunk_items": 512},
            "completion": {"results_retention_s": 600.0},
        }
        config = write_config(root / "worker.toml", "bench", root / "data", [model], 0, more)
        text = config.read_text()
        table = "\n".join(f"{key} = {toml_value(value)}" for key, value in workers.items())
        config.write_text(
            text.replace("[workers]\nlocal = 0\n", f"[workers]\nlocal = 1\n{table}\n")
        )
        self.config, self.broker_config = config, root / "broker.toml"
        self.broker_config.write_text(
            text.replace("[workers]\nlocal = 0\n", f"[workers]\nlocal = 0\n{table}\n")
        )
        self.settings = load_settings(config)
        self.log = root / "batches.log"
        self.broker = self.worker = None

    def __enter__(self) -> JobBroker:
        from assembly.private_broker import start_broker, wait_ready
        from ingest.submit_client import Producer

        self.broker = start_broker(self.broker_config, self.root / "broker.err")
        with Producer(
            self.settings.ingest.bind, timeout_s=30.0, attempts=20, patient=True
        ) as producer:
            if not wait_ready(producer, "none", self._alive, START_TIMEOUT_S):
                raise RuntimeError(f"the broker did not answer; see {self.root / 'broker.err'}")
        with open(self.root / "worker.err", "ab") as err:
            self.worker = subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "bench" / "batch_log_worker.py"),
                    self.config,
                    self.log,
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=REPO,
            )
        return self

    def __exit__(self, *exc) -> None:
        from assembly.private_broker import stop_broker

        if self.worker is not None:
            self.worker.send_signal(signal.SIGTERM)
            try:
                self.worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        if self.broker is not None:
            stop_broker(self.broker, self.settings)

    def batches(self, since: float):
        """The batches the worker's engine began at or after `since` (wall clock)."""
        from bench.batch_log_worker import read_batches

        logged = read_batches(self.log) if self.log.exists() else None
        return logged[logged["began"] >= since] if logged is not None else []

    def _alive(self) -> None:
        if self.worker is not None and self.worker.poll() is not None:
            raise RuntimeError(
                f"the worker stopped (exit {self.worker.returncode}); see {self.root / 'worker.err'}"
            )
        if self.broker.poll() is not None:
            raise RuntimeError(
                f"the broker stopped (exit {self.broker.returncode}); see "
                f"{self.root / 'broker.err'} and {self.root / 'data' / 'log'}"
            )

    def worker_cpu_s(self) -> float:
        """CPU seconds (user + system) the worker process has spent so far."""
        import psutil

        times = psutil.Process(self.worker.pid).cpu_times()
        return times.user + times.system

    def run_job(self, ids: list[list[int]], max_tokens: int, job: str) -> tuple[float, list]:
        """Seconds from the first submitted line to the last result written, and each
        prompt's `choices[0]` (its `text`, its `token_ids`; None for an error line)."""
        from collector.delivery.decoders import model_decoders
        from collector.results_client import ResultsClient
        from ingest.submit_client import Producer

        source = write_job(self.root / f"{job}.jsonl", ids, max_tokens)
        out, err = self.root / f"{job}.out.jsonl", self.root / f"{job}.err.jsonl"
        began = time.perf_counter()
        with Producer(self.settings.ingest.bind, timeout_s=30.0, attempts=20) as producer:
            producer.submit_file(source, job)
        decoders = model_decoders(self.settings)

        def fetch() -> None:
            with ResultsClient(self.settings.completion.bind, timeout_s=10.0, patient=True) as c:
                c.fetch(job, str(out), str(err), follow=True, decoders=decoders)

        fetching = threading.Thread(target=fetch, daemon=True)  # as `run.py results --follow`
        fetching.start()
        while fetching.is_alive():
            fetching.join(timeout=1.0)
            self._alive()  # a worker or broker that died fails the bench, not hangs it
        seconds = time.perf_counter() - began
        got: list = [None] * len(ids)
        for line in out.read_text().splitlines():
            answer = json.loads(line)
            got[int(answer["custom_id"][1:])] = answer["response"]["body"]["choices"][0]
        for name in (source, out, err):
            os.unlink(name)
        return seconds, got


def ratio_rows(
    step: str, direct: str, piped: str, a: list[float], b: list[float], target: float
) -> list[Row]:
    """Rows for paired items/s: side A (`direct`), side B (`piped`), and B / A per pair."""
    ratios = tuple(100 * y / x for x, y in zip(a, b, strict=True))
    return [
        Row(step, f"{direct}: items/s", tuple(a)),
        Row(step, f"{piped}: items/s", tuple(b)),
        Row(
            step,
            f"{piped} / {direct}, % (median of the per-pair ratios)",
            ratios,
            target=f">= {target:.0f}%",
            at_least=target,
        ),
    ]


def same_outputs(a: list, b: list) -> int:
    """How many prompts got the same generated ids on both sides."""
    return sum(1 for x, y in zip(a, b, strict=True) if x is not None and list(x) == list(y or []))
