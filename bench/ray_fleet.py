"""Ray fleet benchmark: cold start, scale-down, and idle share under `run.py fleet`.

Run from the repository root (a few minutes on two cores):

    .venv/bin/python bench/ray_fleet.py [--repeat K] [--lines N] [--scale-down-s S] [--no-docs]

One broker with two models (`alpha`, `beta`), one `[[fleet]]` table each (min 0, max 2,
the simulated engine at 40,000 tokens/s per actor, half a Ray CPU), a local Ray head of
4 CPUs (bench/ray_cluster.py) and `run.py fleet` as a user runs it, following the broker's
`workers_needed` (dispatch.demand_horizon_s = 5 s, so a backlog of more than 5 s of one
worker's work asks for 2).

- Cold start, K times: with the fleet at 0 actors, a job of 200 `alpha` lines is submitted
  (in this process); measured from the submit call to the job's first result (completion's
  count), then from the job's last result to the last actor process gone (`--scale-down-s`
  plus the drain).
- Idle share: N lines of each model are submitted at once to a fleet at 0; every 0.5 s
  the supervisor's metrics are read: per worker session `fabric_worker_idle_seconds_total`,
  per model `fabric_queued_items`. Between two reads where a model had items queued at both,
  its sessions' idle seconds are added up, over the sessions' time in that interval. The
  share is their ratio, over the whole drain of both models. Target: below 2%.

It prints a markdown table and rewrites its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import machine
from bench.ingest_broker import BenchBroker, Model
from bench.ingest_common import progress
from bench.ray_cluster import LocalRay
from bench.report import Row, render_section, write_section
from collector.results_client import ResultsClient
from pipeline.transport.topology import client_address

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "bench/ray_fleet.py"
MODELS = ("alpha", "beta")
TOKENS_PER_S = 40_000.0
PROMPT_TOKENS = 100  # each line's prompt (lane 128)
ACTOR_TITLE = "ray::FleetActor"
SAMPLE_S = 0.5
IDLE_TARGET = 0.02
FLEET = """
[[fleet]]
model = "{model}"
min = 0
max = 2
num_cpus = 0.5
engine = "simulated"
simulated_tokens_per_s = {tokens_per_s}
drain_s = 10.0
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="cold starts measured")
    parser.add_argument("--lines", type=int, default=20000, help="backlog lines per model")
    parser.add_argument("--scale-down-s", type=float, default=5.0, help="the controller's")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-docs", action="store_true", help="print only")
    return parser.parse_args(argv)


def write_lines(path: Path, model: str, n: int) -> Path:
    with open(path, "wb") as out:
        for i in range(n):
            tokens = [1 + (i * 7 + k) % 30000 for k in range(PROMPT_TOKENS)]
            body = {"model": model, "prompt_token_ids": tokens}
            line = {"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/embeddings"}
            out.write(orjson.dumps({**line, "body": body}) + b"\n")
    return path


def submit(config: Path, path: Path, job: str) -> None:
    import run  # the command in this process: no interpreter start in the measure

    code = run.main(["submit", str(path), "--job-id", job, "--config", str(config)])
    if code != 0:
        raise RuntimeError(f"submit {path} exited {code}")


def actors(head: LocalRay) -> int:
    count = 0
    for process in head.processes():
        try:
            count += process.name() == ACTOR_TITLE or process.cmdline()[:1] == [ACTOR_TITLE]
        except psutil.Error:
            continue
    return count


def wait(condition, what: str, timeout_s: float, pause_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(pause_s)
    return value


def cold_start(broker: BenchBroker, head: LocalRay, results: ResultsClient, n: int, root: Path):
    """(seconds to the first result, seconds from the last result to no actor)."""
    wait(lambda: actors(head) == 0, "an idle fleet of 0 actors", 120, 0.2)
    job = f"cold-{n}"
    path = write_lines(root / f"{job}.jsonl", "alpha", 200)
    began = time.monotonic()
    submit(broker.config, path, job)
    wait(lambda: results.job_status(job).get("completed", 0) > 0, "the first result", 120)
    first_s = time.monotonic() - began
    wait(lambda: results.job_status(job).get("completed", 0) == 200, "the last result", 120)
    done = time.monotonic()
    wait(lambda: actors(head) == 0, "the last actor to go", 120, 0.1)
    return first_s, time.monotonic() - done


def scrape(url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """(queued items per model, idle seconds per (model, session)) from the metrics."""
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    queued: dict[str, float] = {}
    idle: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fabric_queued_items":
                queued[s.labels["model"]] = queued.get(s.labels["model"], 0.0) + s.value
            elif s.name == "fabric_worker_idle_seconds_total":
                idle[(s.labels["model"], s.labels["session"])] = s.value
    return queued, idle


def idle_share(broker: BenchBroker, results: ResultsClient, n: int, root: Path) -> dict:
    """Submit n lines of each model at once; the share of worker time idle while its model
    had items queued (module docstring), and what it was measured over."""
    url = f"http://{broker.settings.metrics.bind}/metrics"
    for model in MODELS:
        submit(broker.config, write_lines(root / f"{model}.jsonl", model, n), f"backlog-{model}")
    began = time.monotonic()
    idle_s = worker_s = all_idle_s = 0.0
    peak = 0
    before, before_t = scrape(url), time.monotonic()
    while True:
        time.sleep(SAMPLE_S)
        after, after_t = scrape(url), time.monotonic()
        for key, idle in after[1].items():
            if key not in before[1]:
                continue
            grew = max(0.0, idle - before[1][key])
            all_idle_s += grew  # whether or not work was queued: the counter moves
            if before[0].get(key[0], 0) > 0 and after[0].get(key[0], 0) > 0:
                idle_s += grew
                worker_s += after_t - before_t
        peak = max(peak, len(after[1]))
        before, before_t = after, after_t
        done = [results.job_status(f"backlog-{m}").get("completed", 0) for m in MODELS]
        if all(d == n for d in done):
            break
        if after_t - began > 900:
            raise RuntimeError(f"the backlog did not drain in 900 s: {done} of {n} each")
    return {
        "share": idle_s / worker_s if worker_s else 0.0,
        "idle_s": idle_s,
        "all_idle_s": all_idle_s,
        "worker_s": worker_s,
        "drain_s": time.monotonic() - began,
        "peak": peak,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ray-fleet-", dir=args.dir))
    facts = machine.describe(args.dir)
    started = time.perf_counter()
    sections = {
        "dispatch": {"demand_horizon_s": 5.0, "session_timeout_s": 5.0, "report_s": 0.5},
        "metrics": {"interval_s": 0.5},
    }
    broker = BenchBroker(root / "broker", [Model(m) for m in MODELS], sections=sections)
    with open(broker.config, "a") as config:
        for model in MODELS:
            config.write(FLEET.format(model=model, tokens_per_s=TOKENS_PER_S))
    head = LocalRay(num_cpus=4)
    controller: subprocess.Popen | None = None
    cold: list[tuple[float, float]] = []
    try:
        broker.start()
        head.start()
        progress(f"broker and Ray head up; controller against {head.address}")
        argv = [sys.executable, str(REPO / "run.py"), "fleet", "--ray", head.address]
        argv += ["--config", str(broker.config), "--scale-down-s", str(args.scale_down_s)]
        log = open(root / "fleet.log", "w")  # noqa: SIM115 (the child keeps it)
        controller = subprocess.Popen([*argv, "--interval-s", "0.5"], stderr=log, cwd=REPO)
        log.close()
        address = client_address(broker.settings.completion.bind)
        with ResultsClient(address) as results:
            for n in range(args.repeat):
                cold.append(cold_start(broker, head, results, n, root))
                progress(f"cold start {n + 1}: first result {cold[-1][0]:.1f} s")
            wait(lambda: actors(head) == 0, "an idle fleet", 120, 0.2)
            share = idle_share(broker, results, args.lines, root)
        progress(f"idle share {100 * share['share']:.2f}% over {share['worker_s']:.0f} worker-s")
        wait(lambda: actors(head) == 0, "the fleet back to 0", 120, 0.2)
        stopped = broker.stop()
    finally:
        if controller is not None:
            controller.send_signal(signal.SIGTERM)
            controller.wait(timeout=60)
        head.stop()
        broker.close()
    rows = [
        Row("cold start, the controller just started", "submit to first result, s", cold[0][:1]),
        Row(
            "cold start (0 actors), controller running",
            "submit to first result, s",
            tuple(c[0] for c in cold[1:]) or cold[0][:1],
        ),
        Row("scale down", "last result to no actor, s", tuple(c[1] for c in cold)),
        Row(
            "drain of 2 models",
            "worker time idle while its model had work queued, %",
            (100 * share["share"],),
            target="below 2%",
            below=100 * IDLE_TARGET,
        ),
    ]
    body = render_section(
        "Ray fleet (bench/ray_fleet.py)",
        "`run.py fleet` on a local Ray head: how long a job waits for a fleet at 0 actors, "
        "how long the last actor stays after the queue drains, and how much of its workers' "
        "time a fleet leaves idle while their model has work.",
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        rows,
        [
            f"`[[fleet]]` per model: min 0, max 2, num_cpus 0.5, simulated engine at "
            f"{TOKENS_PER_S:,.0f} tokens/s; `--scale-down-s {args.scale_down_s:g}`, "
            "`--interval-s 0.5`; dispatch.demand_horizon_s = 5 s.",
            "Cold start: 200 lines of 100 tokens; the time includes the controller's next turn "
            "and its read of the demand, Ray placing the actor, its process start and "
            "imports, the engine's load and the worker's registration. The first job also "
            "waits for the controller's own connection to Ray and Ray's first worker process "
            "of the actors' runtime environment.",
            f"Idle share: {args.lines:,} lines of each model submitted at once to a fleet at 0; "
            f"{share['worker_s']:.0f} worker-seconds while work was queued, drained in "
            f"{share['drain_s']:.0f} s, up to {share['peak']} worker sessions at once; "
            f"{share['idle_s']:.2f} s of it idle. Over the whole drain, the queue empty "
            f"included, the same sessions counted {share['all_idle_s']:.1f} idle seconds "
            "(the counter moves: the workers wait once their model's queue is empty).",
            "Idle seconds are the workers' own (`fabric_worker_idle_seconds_total`: nothing "
            "queued or running); a session's first interval counts once it is in two reads.",
        ],
        checks=[(f"broker stopped by SIGTERM with exit code 0: {stopped}", stopped == 0)],
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
