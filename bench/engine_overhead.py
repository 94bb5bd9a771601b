"""What the broker costs a real engine: `minilm` alone against the whole pipeline, same corpus.

    python bench/engine_overhead.py [--repeats 3] [--dir DIR] [--no-docs]

In one run, on the demo corpus (the paragraphs of the Python documentation
that CPython ships, cli/demo.py):

1. the `minilm` engine alone: the corpus tokenised with the model's
   tokenizer, grouped into the demo's lanes (32, 64, 128, 256 tokens),
   run in batches of 64 items of one lane, as the broker hands them out:
   items/s and real tokens/s, and the padding waste (lane slots that carry
   no token, as a share of all lane slots);
2. the whole pipeline: a broker with one local `minilm` worker (same
   threads, same lanes, batches of 64, no adaptive sizing), timed from the
   first submitted line until the results client has written and fsynced
   the last result;
3. the ratio of the two: target >= 97% (the broker costs <= 3%, issue 19),
   and padding waste < 20% of tokens;
4. where the pipeline's time went (bench/engine_timeline.py), from the
   worker's record of its batches (bench/batch_log_worker.py: the worker is
   started by the bench, the broker runs with `local = 0`): first line to
   first batch, the engine's time against the engine alone's, gaps between
   batches, last batch to last result fsynced; each as a share of the wall
   time, so the table says what bounds the ratio;
5. the CPU seconds each process took over the timed job: what the engine's
   threads competed with for the cores.

Writes its section of docs/BENCHMARKS.md unless `--no-docs`; `--items N`
runs the first N texts only.

    python bench/engine_overhead.py --lists [--per-line 64] [--items N] [--repeats 4]

compares instead, through the same pipeline, the corpus sent as embeddings
`input` lists of `--per-line` strings (fan-out: one item per string, joined
back into one response line) with the same strings one per line: items/s of
each and their ratio, target within 5%, in paired, interleaved repeats, with
the batches the engine ran and the CPU of each stage to tell a cost of
fan-out from engine noise (bench/engine_lists.py). Writes its own section.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.batch_log_worker import read_batches  # noqa: E402
from bench.engine_timeline import BROKER, broker_cpu, cost_shares, timeline  # noqa: E402
from bench.machine import command_line, describe, load_average  # noqa: E402
from bench.report import Row, render_section, write_section  # noqa: E402

LANES = (16, 24, 32, 48, 64, 96, 128, 192, 256)  # as cli/demo.py writes them
BATCH = 64
DOC = REPO / "docs" / "BENCHMARKS.md"


def tokenised(texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    from gpu.engines.minilm import minilm_tokenizer_path

    tokenizer = Tokenizer.from_file(str(minilm_tokenizer_path()))
    return [e.ids for e in tokenizer.encode_batch(texts)]


def lane_batches(ids: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens [n, lane], lengths) per batch: items grouped by lane, in input order."""
    by_lane: dict[int, list[list[int]]] = {lane: [] for lane in LANES}
    for row in ids:
        lane = next(lane for lane in LANES if lane >= len(row))
        by_lane[lane].append(row)
    batches = []
    for lane, rows in by_lane.items():
        for start in range(0, len(rows), BATCH):
            part = rows[start : start + BATCH]
            tokens = np.zeros((len(part), lane), np.uint32)
            for i, row in enumerate(part):
                tokens[i, : len(row)] = row
            batches.append((tokens, np.array([len(r) for r in part], np.uint32)))
    return batches


def engine_alone(batches) -> tuple[float, int, int]:
    """Seconds for every batch through a loaded engine; real tokens; lane slots."""
    from gpu.engines.base import EMBED, EngineBatch
    from gpu.engines.registry import make_engine

    engine = make_engine("minilm")
    engine.load()
    began = time.perf_counter()
    for tokens, lengths in batches:
        result = engine.run(EngineBatch(EMBED, tokens, lengths))
        assert all(e is None for e in result.errors)
    seconds = time.perf_counter() - began
    real = int(sum(int(lengths.sum()) for _, lengths in batches))
    slots = int(sum(tokens.size for tokens, _ in batches))
    return seconds, real, slots


def write_corpus(path: Path, texts: list[str], per_line: int) -> None:
    with open(path, "w") as out:
        for i in range(0, len(texts), per_line):
            group = texts[i : i + per_line]
            body = {"model": "minilm", "input": group if per_line > 1 else group[0]}
            line = {"custom_id": f"p{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(json.dumps(line) + "\n")


def stage_cpu(data_root: Path) -> dict[str, float]:
    """CPU seconds (user + system) each running stage process has spent, by stage label."""
    import psutil

    from pipeline.process.supervisor_report import read_report, stage_pids

    out = {}
    for label, pid in stage_pids(read_report(data_root)).items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[label] = times.user + times.system
    return out


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has spent so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def pipeline(
    root: Path,
    texts: list[str],
    per_line: int = 1,
    cpu: dict[str, float] | None = None,
    batches: dict | None = None,
) -> float:
    """Seconds from the first submitted line to the last result delivered (one local worker);
    `per_line` > 1 sends the texts as embeddings `input` lists of that many strings. A warm-up
    job (the first 128 texts, in the same form) runs to the end before the clock starts.
    `cpu`, when given, gets each stage's CPU seconds over the timed job (and `client`: this
    process's, which submits and fetches). `batches`, when given, gets the batches the engine
    ran for the timed job (`log`: bench/batch_log_worker.py's records) and the job's wall-clock
    `began` and `ended`: the worker is then started by this bench as that logging worker,
    with the options the supervisor would give it, and the broker runs with `local = 0`."""
    from cli.demo import demo_config
    from collector.results_client import ResultsClient
    from config import load_settings
    from ingest.submit_client import Producer

    root.mkdir(parents=True, exist_ok=True)
    corpus, warm = root / "corpus.jsonl", root / "warm.jsonl"
    write_corpus(corpus, texts, per_line)
    write_corpus(warm, texts[:128], per_line)
    config = demo_config(root, workers=1)
    text = config.read_text().replace("prefetch = 2", "prefetch = 2\ntarget_batch_s = 0.0")
    config.write_text(text)
    settings = load_settings(config)
    broker_config, worker = config, None
    if batches is not None:
        broker_config = root / "broker.toml"
        broker_config.write_text(text.replace("local = 1", "local = 0"))
    broker = subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--config", str(broker_config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        with Producer(settings.ingest.bind, timeout_s=30.0, attempts=20, patient=True) as producer:
            producer.catalog()  # the broker is up (its workers load the model meanwhile)
            if batches is not None:
                log = root / "batches.log"
                worker = subprocess.Popen(
                    [sys.executable, str(REPO / "bench" / "batch_log_worker.py"), config, log],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=REPO,
                )
            producer.submit_file(warm, "warm-up")
            with ResultsClient(settings.completion.bind, timeout_s=10.0, patient=True) as client:
                client.fetch("warm-up", str(root / "warm.out"), str(root / "warm.err"), follow=True)
            before, client_before = stage_cpu(settings.data_path), time.process_time()
            if worker is not None:
                before["worker-0"] = process_cpu(worker.pid)
            began, began_wall = time.perf_counter(), time.time()
            job = f"bench-{time.time_ns()}"
            producer.submit_file(corpus, job)
            submitted = time.time()  # every line acknowledged: durable in the input log
        with ResultsClient(settings.completion.bind, timeout_s=10.0, patient=True) as client:
            report = client.fetch(
                job, str(root / "out.jsonl"), str(root / "err.jsonl"), follow=True
            )
        seconds = time.perf_counter() - began
        if cpu is not None:
            after = stage_cpu(settings.data_path)
            if worker is not None:
                after["worker-0"] = process_cpu(worker.pid)
            cpu.update({k: after[k] - before[k] for k in after if k in before})
            cpu["client"] = time.process_time() - client_before
        if batches is not None:
            batches["began"], batches["ended"] = began_wall, began_wall + seconds
            batches["submitted"] = submitted
            logged = read_batches(log)
            batches["log"] = logged[logged["began"] >= began_wall]
        lines = -(-len(texts) // per_line)
        assert report.written == lines, (report.written, report.errors)
        return seconds
    finally:
        for process in (worker, broker):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)


def timeline_rows(parts, shares, spent, items: int) -> list[Row]:
    """Rows 4 and 5: where the pipeline's wall time went, and who else took CPU meanwhile."""
    labels = {
        "submit": "first line submitted -> last acknowledged (overlaps the rest), s",
        "start": "first line submitted -> the engine's first batch, s",
        "engine": "engine busy in the pipeline, s",
        "alone": "engine alone (same repeat), s",
        "gaps": "engine idle between batches, s",
        "largest gap": "largest of those gaps, s",
        "tail": "last batch done -> last result fsynced, s",
    }
    rows = [Row("4 timeline", label, tuple(parts[name])) for name, label in labels.items()]
    rows += [Row("4 timeline", name, tuple(parts[name])) for name in ("batches", "items per batch")]
    rows += [
        Row("4 cost", f"{name}, % of the pipeline's wall", tuple(shares[name])) for name in shares
    ]
    for label in sorted(spent, key=lambda k: -max(spent[k])):
        if label == BROKER or max(spent[label]) >= 0.05:
            per = tuple(1000 * v / items for v in spent[label])
            rows.append(Row("5 CPU", f"{label}: CPU s per 1,000 items", per))
    return rows


def fresh_run(args) -> tuple[Path, dict[str, str], list[str]]:
    """An empty `--dir`, the machine's facts, and the demo corpus (its first `--items` texts)."""
    from cli.demo import corpus

    bench_dir = Path(args.dir)
    subprocess.run(["rm", "-rf", str(bench_dir)], check=True)
    bench_dir.mkdir(parents=True)
    texts = corpus()
    return bench_dir, describe(bench_dir), texts[: args.items] if args.items else texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="3; with --lists 4 (pairs, even)")
    parser.add_argument("--dir", default=str(REPO / "var" / "bench-engine"))
    parser.add_argument("--lists", action="store_true", help="list input against one per line")
    parser.add_argument("--per-line", type=int, default=64, help="strings per list line")
    parser.add_argument("--items", type=int, default=0, help="use the first N texts (0: all)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args()
    if args.lists:
        from bench.engine_lists import lists_against_single

        args.repeats = args.repeats or 4
        return lists_against_single(args)
    args.repeats = args.repeats or 3
    started = time.monotonic()
    bench_dir, facts, texts = fresh_run(args)
    ids = tokenised(texts)
    batches = lane_batches(ids)
    alone, piped = [], []
    parts: dict[str, list[float]] = {}  # the timeline of each pipeline run (engine_timeline.py)
    shares: dict[str, list[float]] = {}
    spent: dict[str, list[float]] = {}  # CPU seconds by process over each timed job
    real = slots = 0
    for r in range(args.repeats):
        seconds, real, slots = engine_alone(batches)
        alone.append(len(texts) / seconds)
        print(f"engine alone: {alone[-1]:.0f} items/s", file=sys.stderr)
        cpu, record = {}, {}
        piped.append(len(texts) / pipeline(bench_dir / f"run{r}", texts, 1, cpu, record))
        run = timeline(record, seconds)
        for name, value in run.items():
            parts.setdefault(name, []).append(value)
        for name, value in cost_shares(run).items():
            shares.setdefault(name, []).append(value)
        for name, value in broker_cpu(cpu).items():
            spent.setdefault(name, []).append(value)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in run.items())
        used = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()))
        print(f"pipeline: {piped[-1]:.0f} items/s; s: {shown}; CPU s: {used}", file=sys.stderr)
    ratios = tuple(p / a for p, a in zip(piped, alone, strict=True))
    waste = 1 - real / slots
    rows = [
        Row("1 engine alone", "minilm, batches of 64 from lanes: items/s", tuple(alone)),
        Row(
            "1 engine alone",
            "real tokens/s",
            tuple(a * real / len(texts) for a in alone),
        ),
        Row(
            "1 engine alone",
            "padding waste, % of lane slots",
            (100 * waste,),
            target="< 20%",
            below=20.0,
        ),
        Row("2 pipeline", "submit -> last result delivered: items/s", tuple(piped)),
        Row(
            "3 overhead",
            "pipeline / engine alone, % (paired by repeat)",
            tuple(100 * x for x in ratios),
            target=">= 97%",
            at_least=97.0,
        ),
        *timeline_rows(parts, shares, spent, len(texts)),
    ]
    facts["load average at end"] = load_average()
    notes = [
        f"Corpus: {len(texts)} paragraphs of the Python documentation topics (pydoc_data), "
        f"{real:,} real tokens (mean {real / len(texts):.1f}), lanes {list(LANES)}.",
        "Engine alone: `make_engine('minilm')` (ONNX Runtime, threads = cores), loaded and "
        "warmed up before the clock starts; every batch of 64 items of one lane, in order.",
        "Pipeline: `run.py --config` as `run.py demo` writes it (one local minilm worker, "
        "batch_items 64, target_batch_s 0), timed from the first submitted line, after the "
        "broker answers, until `ResultsClient.fetch(follow=True)` has written and fsynced "
        "every result; submit, dispatch, the engine, completion and delivery overlap on the "
        "same 2 cores.",
        "Padding waste: lane slots carrying no token / all lane slots of the batches.",
        "The worker is local worker 0 of that config (2 threads), started by the bench as "
        "bench/batch_log_worker.py (the broker at `local = 0`) so that it records each batch: "
        "the `4 timeline` rows come from that record over the timed job. `4 cost` rows: each "
        "part as a share of the pipeline's wall time; with `engine slower than alone` (the "
        "engine's own time in the pipeline less the engine alone's in the same repeat: other "
        "processes on its cores, or other batches, see `batches`) they add up to 100% - the "
        "ratio. `5 CPU` rows: CPU seconds of each process over the timed job per 1,000 items "
        "(`client`: this process, which submits and fetches); on a loaded host a slow run "
        "inflates the idle share of these, which is time-proportional.",
    ]
    body = render_section(
        "Engine overhead (bench/engine_overhead.py)",
        "What the broker costs a real engine: `minilm` alone against the whole pipeline on "
        "the demo corpus.",
        command_line(),
        time.monotonic() - started,
        facts,
        rows,
        notes,
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, "bench/engine_overhead.py", body)
    subprocess.run(["rm", "-rf", str(bench_dir)], check=False)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
