"""Result reuse (docs/completion.md, "Result reuse"): a rerun, the cost at ingest, the index.

1. rerun: an embeddings file of `--lines` text lines (20-40 words each)
   through a broker with one local worker of the simulated engine at
   `--tokens-per-s` (default: the config's default speed), as a user runs it:
   `run.py submit --reuse`, then `run.py results --follow`; then the same file
   with every tenth line changed, again `--reuse`. Target: the second run
   takes at most 15% of the first's time.
2. ingest: the same file submitted to a broker without workers, with and
   without `--reuse`, in pairs (the order alternating), into an index holding
   1M entries (none of the file's: every lookup probes and misses, the cost a
   first night pays). Target: `--reuse` keeps at least 80% of the items/s.
3. index: the table (pipeline/store/reuse_table.py) at each of `--entries`:
   its file, this process's memory before and after, inserts, and lookups of
   4,096 keys at once (half present, half absent: what the front does per chunk).

    .venv/bin/python -m bench.reuse [--lines N] [--repeat K] [--entries 1000000,10000000]
                                    [--tokens-per-s T] [--dir PATH] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import machine
from bench.ingest_broker import BenchBroker, Model
from bench.ingest_text import build_tokenizer, vocabulary, write_batch_file
from bench.report import Row, render_section, write_section
from config.defaults import DEFAULTS
from pipeline.store.reuse_store import REUSE_DIR
from pipeline.store.reuse_table import SLOT, TABLE_FILE, ReuseTable, capacity_for

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "reuse"
MODEL = "texty"
RUN_TIMEOUT_S = 3600.0
LOOKUP_KEYS = 4096


def progress(text: str) -> None:
    print(f"[reuse] {text}", file=sys.stderr, flush=True)


def memory_kib() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, KiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


# ---- 3. the index ---------------------------------------------------------------------------
def bench_index(root: Path, entries: int, rng: np.random.Generator) -> dict[str, float]:
    """Build a table of `entries` random keys (a block of 1M at a time, as completion indexes a
    step's results), then map it read-only as the front does and time lookups of LOOKUP_KEYS
    at once, half present and half absent."""
    path = root / f"table-{entries}.bin"
    before = memory_kib()
    ReuseTable.create(path, capacity_for(entries))
    table = ReuseTable(path, writable=True)
    pool = []  # some present keys, for the lookups (at most 40,960 per block: 640 KiB)
    insert_s = 0.0
    for start in range(0, entries, 1_000_000):
        part = rng.integers(1, 2**63, size=(min(1_000_000, entries - start), 2), dtype=np.uint64)
        rows = np.zeros(len(part), SLOT)
        rows["k0"], rows["k1"] = part[:, 0], part[:, 1]
        rows["file"], rows["offset"], rows["length"] = 1, start, 64
        pool.append(part[:40_960].copy())
        t0 = time.perf_counter()
        table.insert(rows)
        insert_s += time.perf_counter() - t0
        del part, rows
    table.sync()
    table.close()
    present_pool = np.concatenate(pool)
    built = memory_kib()
    reader = ReuseTable(path, writable=False)
    mapped = memory_kib()
    times = []
    half = LOOKUP_KEYS // 2
    for _ in range(100):
        present = present_pool[rng.choice(len(present_pool), half, replace=False)]
        absent = rng.integers(1, 2**63, size=(half, 2), dtype=np.uint64)
        batch = np.concatenate([present, absent])
        t0 = time.perf_counter()
        at = reader.find(batch)
        times.append(time.perf_counter() - t0)
        assert (at[:half] >= 0).all() and (at[half:] < 0).all()
    after = memory_kib()
    reader.close()
    size = path.stat().st_size
    on_disk = path.stat().st_blocks * 512
    path.unlink()
    pool_kib = present_pool.nbytes / 1024
    return {
        "insert_per_s": entries / insert_s,
        "lookup_us": 1e6 * statistics.median(times) / LOOKUP_KEYS,
        "file_mib": size / (1 << 20),
        "disk_mib": on_disk / (1 << 20),
        "writer_heap_mib": (built["RssAnon"] - before["RssAnon"] - pool_kib) / 1024,
        "reader_heap_mib": (after["RssAnon"] - built["RssAnon"]) / 1024,
        "mapped_mib": (after["RssFile"] - mapped["RssFile"]) / 1024,
    }


# ---- 1 and 2: a broker ----------------------------------------------------------------------
def write_inputs(root: Path, lines: int, rng: np.random.Generator) -> tuple[Path, Path, Path]:
    """(tokenizer, the file, the file with every tenth line changed)."""
    words = vocabulary(rng)
    tokenizer = build_tokenizer(root / "tokenizer.json", words)
    source = root / "requests.jsonl"
    write_batch_file(source, lines, MODEL, words, rng)
    changed = root / "requests-changed.jsonl"
    import orjson

    with open(source, "rb") as f, open(changed, "wb") as out:
        for i, line in enumerate(f):
            if i % 10 == 9:  # one more word: another request
                request = orjson.loads(line)
                request["body"]["input"] = f"{words[i % len(words)]} {request['body']['input']}"
                line = orjson.dumps(request, option=orjson.OPT_APPEND_NEWLINE)
            out.write(line)
    return tokenizer, source, changed


def run_file(broker: BenchBroker, source: Path, out: Path, *flags: str) -> tuple[float, float, str]:
    """(seconds from `run.py submit` to `run.py results --follow` ending, seconds of the
    submit alone, the job id)."""
    run = [sys.executable, str(REPO / "run.py")]
    config = ["--config", str(broker.config)]
    started = time.perf_counter()
    job = subprocess.run(
        [*run, "submit", str(source), *config, *flags],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=RUN_TIMEOUT_S,
    ).stdout.split()[-1]
    submitted = time.perf_counter() - started
    subprocess.run(
        [*run, "results", job, "-o", str(out), "--errors", f"{out}.err", "--follow", *config],
        capture_output=True,
        check=True,
        cwd=REPO,
        timeout=RUN_TIMEOUT_S,
    )
    seconds = time.perf_counter() - started
    progress(f"{source.name}: submitted in {submitted:.2f} s, results all in at {seconds:.2f} s")
    return seconds, submitted, job


def job_info(broker: BenchBroker, job: str) -> dict:
    info = subprocess.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "status",
            job,
            "--json",
            "--config",
            str(broker.config),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    import orjson

    return orjson.loads(info)


def bench_rerun(root: Path, tokenizer: Path, source: Path, changed: Path, rate: float, lines: int):
    workers = {"local": 1, "model": MODEL, "simulated_tokens_per_s": rate}
    model = Model(MODEL, str(tokenizer), engine="simulated")
    broker = BenchBroker(root / "rerun", [model], sections={"workers": workers})
    broker.start()
    try:
        first = run_file(broker, source, root / "first.jsonl", "--reuse")
        second = run_file(broker, changed, root / "second.jsonl", "--reuse")
        infos = [job_info(broker, run[2]) for run in (first, second)]
        if broker.stop() != 0:
            raise RuntimeError("the broker did not stop cleanly")
        code, said = broker.check()
        if code != 0:
            raise RuntimeError(f"check found problems: {said}")
    finally:
        broker.close()
    for name in ("first.jsonl", "second.jsonl"):
        got = (root / name).read_bytes().count(b"\n")
        if got != lines:
            raise RuntimeError(f"{name} has {got} lines, not {lines}")
    return first, second, infos


def seed_index(data: Path, entries: int, rng: np.random.Generator) -> None:
    """A reuse table of `entries` random keys in a data dir not yet started."""
    root = data / REUSE_DIR
    root.mkdir(parents=True, exist_ok=True)
    ReuseTable.create(root / TABLE_FILE, capacity_for(entries))
    table = ReuseTable(root / TABLE_FILE, writable=True)
    rows = np.zeros(entries, SLOT)
    rows["k0"], rows["k1"] = rng.integers(1, 2**63, size=(2, entries), dtype=np.uint64)
    rows["file"], rows["length"] = 1, 64
    table.insert(rows)
    table.sync()
    table.close()


def submit_seconds(root: Path, tokenizer: Path, source: Path, reuse: bool, rng) -> float:
    """A fresh broker without workers; seconds of `Producer.submit_file` of the whole file."""
    from ingest.submit_client import Producer

    broker = BenchBroker(root, [Model(MODEL, str(tokenizer))])
    seed_index(broker.data, 1_000_000, rng)
    broker.start()
    try:
        with Producer(broker.address, timeout_s=120.0) as producer:
            producer.catalog()
            started = time.perf_counter()
            producer.submit_file(source, reuse=reuse)
            seconds = time.perf_counter() - started
        broker.stop()
    finally:
        broker.close()
        shutil.rmtree(root, ignore_errors=True)
    return seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3, help="pairs of the ingest step")
    parser.add_argument("--entries", default="1000000,10000000")
    parser.add_argument(
        "--tokens-per-s",
        default=f"{DEFAULTS['workers']['simulated_tokens_per_s']:.0f},10000",
        help="speeds of the simulated engine for the rerun step, comma-separated: one rerun each",
    )
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-reuse")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave the docs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"reuse-{os.getpid()}"
    root.mkdir()
    facts = machine.describe(args.dir)
    started = time.perf_counter()
    rng = np.random.default_rng(20261207)
    index: dict[int, dict[str, float]] = {}
    plain, reusing = [], []
    try:
        tokenizer, source, changed = write_inputs(root, args.lines, rng)
        reruns = {}
        for rate in [float(r) for r in args.tokens_per_s.split(",")]:
            progress(f"rerun at {rate:,.0f} tokens/s: {args.lines:,} lines, then a tenth changed")
            reruns[rate] = bench_rerun(
                root / f"rate-{rate:.0f}", tokenizer, source, changed, rate, args.lines
            )
        for r in range(args.repeat):
            order = (False, True) if r % 2 == 0 else (True, False)
            for reuse in order:
                progress(f"ingest pair {r + 1}: {'with' if reuse else 'without'} --reuse")
                seconds = submit_seconds(
                    root / f"ingest-{r}-{reuse}", tokenizer, source, reuse, rng
                )
                (reusing if reuse else plain).append(args.lines / seconds)
        for entries in [int(e) for e in args.entries.split(",")]:
            progress(f"index: {entries:,} entries")
            index[entries] = bench_index(root, entries, rng)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    facts["load average at end"] = machine.load_average()
    rows = []
    for rate, (first, second, infos) in reruns.items():
        step = f"1 rerun, engine {rate / 1000:g}k tokens/s"
        work = [float(info["worker_s"]) for info in infos]
        rows += [
            Row(step, "first run, s (submit --reuse + results --follow)", (first[0],)),
            Row(step, "  of which submit, s", (first[1],)),
            Row(step, "second run, 10% changed, s", (second[0],)),
            Row(step, "  of which submit, s", (second[1],)),
            Row(step, "lines reused by the second run", (float(infos[1]["reused"]),)),
            Row(step, "engine seconds, first run (workers' measure)", (work[0],)),
            Row(step, "engine seconds, second run", (work[1],)),
            Row(step, "engine seconds, second / first", (work[1] / work[0],), percent=True),
            Row(
                step,
                "second / first, wall time",
                (second[0] / first[0],),
                percent=True,
                target="<= 15%",
                below=0.15000001,
            ),
        ]
    rows += [
        Row("2 ingest", "items/s submitted without --reuse", tuple(plain)),
        Row("2 ingest", "items/s submitted with --reuse", tuple(reusing)),
        Row(
            "2 ingest",
            "with / without (each pair)",
            tuple(b / a for a, b in zip(plain, reusing, strict=True)),
            percent=True,
            target=">= 80%",
            at_least=0.8,
        ),
    ]
    for entries, m in index.items():
        step = f"3 index {entries / 1e6:g}M"
        rows += [
            Row(step, "table file, MiB (on disk)", (m["disk_mib"],)),
            Row(step, "inserts/s (vectorised, 1M a call)", (m["insert_per_s"],)),
            Row(step, f"lookup, us per key ({LOOKUP_KEYS:,} at once)", (m["lookup_us"],)),
            Row(step, "heap kept by the writer after the build, MiB", (m["writer_heap_mib"],)),
            Row(step, "heap kept by the reader after 100 lookups, MiB", (m["reader_heap_mib"],)),
            Row(step, "table pages 100 lookups mapped in, MiB", (m["mapped_mib"],)),
        ]
    notes = [
        f"Rerun: {args.lines:,} `/v1/embeddings` lines of 20-40 words (a word-level tokenizer "
        "over 30,000 random words, as bench/ingest_text.py), one local worker of the "
        f"`simulated` engine at each of {args.tokens_per_s} tokens/s (the first is the "
        "config's default speed; it sleeps for each batch's padded tokens; 10,000 stands for "
        "an engine whose compute dominates the run, as a real model's does: minilm measured "
        "about 50 items/s on this host, bench/engine_overhead.py), a new broker for each speed "
        "and one for both of its runs; each run "
        "is `run.py submit FILE --reuse` then `run.py results JOB --follow` as a user types "
        "them, timed from the first to the end of the second. The second file is the first "
        "with one more word in every tenth line. The second run's time is what does not "
        "shrink with reuse (parsing and keying every line, storing and delivering every "
        "result) plus a tenth of the engine's work: the share falls as the engine gets slower "
        "per line (a real model) and rises as it gets faster.",
        "Ingest: `Producer.submit_file` of the same file to a fresh broker without workers "
        "(chunks of 4,096 lines, one tokenizer process), until the last chunk is durable; "
        "the data dir's reuse table holds 1M random entries first, so with --reuse every line "
        "is keyed and its lookup probes a real table and misses. Each pair ran one after the "
        "other, the order alternating; the ratio is taken within each pair.",
        "Index: ReuseTable built in this process (random 16-byte keys, 1M per insert call; "
        "capacity a power of two at most half full), then mapped again read-only as the front "
        f"maps it; 100 lookups of {LOOKUP_KEYS:,} keys, half present and half absent, median "
        "per key. Heap kept is RssAnon growth (the writer's: after the build, less the sample "
        "of keys kept for the lookups; the reader's: over the lookups): what stays with the "
        "process as the index grows. Table pages mapped in is RssFile growth over the 100 "
        "lookups: file pages of the page cache, shared with the writer and given back under "
        "memory pressure, about one 4 KiB page per key looked up. A rebuild (the table "
        "doubling, or an eviction) copies the used slots once: 32 bytes per entry, for its "
        "length only.",
        f"Sizes: --lines {args.lines:,}, --repeat {args.repeat}, --entries {args.entries}.",
    ]
    body = render_section(
        "Result reuse (bench/reuse.py)",
        "A 100,000-line embeddings file run with `--reuse` and again with 10% of its lines "
        "changed; ingest with and without `--reuse`; the index at 1M and 10M entries.",
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        rows,
        notes,
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
