"""Vector shards: durable append throughput, recovery time, exact search latency and memory.

    .venv/bin/python -m bench.vectors [--quick]

(a) appends 384-dim float32 rows in batches of 4096, one flush per batch,
against the disk's own pwrite + fdatasync bandwidth measured in the same run;
(b) opens a large float16 shard (as big as the disk and a time budget allow,
up to 10 M rows) and times `Shard.open` and `VectorStore` open;
(c) times exact search of 1 and 16 queries over the rows of (a) against one
numpy matmul over the same rows in memory; (d) measures the peak RSS of a
search in a fresh process. Data lives under var/bench-vectors, removed after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import disk, machine
from bench.report import Row, render_section, write_section
from collector.vectors.search import search
from collector.vectors.shard import Shard
from collector.vectors.vector_store import VectorStore

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "var" / "bench-vectors"
DOC = ROOT / "docs" / "BENCHMARKS.md"
DIM = 384
BATCH = 4096
FLUSH_S = 0.1  # vectors.flush_ms
SEARCH_ROWS = 1_000_000
RECOVERY_ROWS = 10_000_000
RECOVERY_BUILD_S = 60.0  # time allowed to build the recovery shard
REPEAT = 5
PROBE = (sys.executable, "-m", "bench.vectors", "--rss-probe")


def _batch(rng: np.random.Generator, rows: int) -> np.ndarray:
    return rng.standard_normal((rows, DIM), dtype=np.float32)


def bench_append(store_dir: Path, rows: int) -> tuple[list[float], float, list[int]]:
    """Append `rows` in pages of BATCH rows, flushing every FLUSH_S as the manager does
    (collector/vectors/vector_stage.py: rows queue up between scheduled flushes); per-slice rows/s,
    the total seconds and the bytes of each flush."""
    rng = np.random.default_rng(0)
    pool = _batch(rng, BATCH * 4)  # reuse a few batches: generating is not the thing timed
    rates, total_s, flushes = [], 0.0, []
    per_slice = max(1, rows // BATCH // REPEAT)
    with VectorStore(store_dir, DIM, "float32", rows) as store:
        done = 0
        while done < rows:
            started = last_flush = time.perf_counter()
            written = 0
            for _ in range(per_slice):
                n = min(BATCH, rows - done - written)
                if n <= 0:
                    break
                slot = (done // BATCH + written // BATCH) % 4
                ids = np.arange(done + written, done + written + n, dtype=np.uint64)
                store.append(ids, pool[slot * BATCH : slot * BATCH + n], copy=False)
                written += n
                if time.perf_counter() - last_flush >= FLUSH_S:
                    flushes.append(store.pending_rows * DIM * 4)
                    store.flush()
                    last_flush = time.perf_counter()
            flushes.append(store.pending_rows * DIM * 4)
            store.flush()
            seconds = time.perf_counter() - started
            total_s += seconds
            rates.append(written / seconds)
            done += written
    return rates, total_s, [f for f in flushes if f]


def build_recovery_shard(directory: Path, rows: int) -> int:
    """A float16 shard of up to `rows` rows written through Shard (batches of 65536, one flush
    each), stopping at RECOVERY_BUILD_S; the rows it holds."""
    rng = np.random.default_rng(1)
    block = rng.standard_normal((65536, DIM), dtype=np.float32).astype(np.float16)
    started = time.perf_counter()
    with Shard.create(directory, 0, DIM, "float16") as shard:
        while shard.rows < rows and time.perf_counter() - started < RECOVERY_BUILD_S:
            n = min(len(block), rows - shard.rows)
            shard.append(np.arange(shard.rows, shard.rows + n, dtype=np.uint64), block[:n])
            shard.flush()
        shard.seal()
        return shard.rows


def timed(fn, repeat: int = REPEAT) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def bench_recovery(directory: Path) -> tuple[list[float], list[float], list[float], str]:
    """Warm open times (Shard, VectorStore) and cold Shard.open times, and how it evicted."""

    def open_shard() -> None:
        Shard.open(directory, 0).close()

    def open_store() -> None:
        VectorStore(directory, DIM, "float16", RECOVERY_ROWS).close()

    warm_shard, warm_store = timed(open_shard), timed(open_store)
    cold, how = [], ""
    for _ in range(REPEAT):
        how = disk.evict(sorted(directory.iterdir()))
        cold += timed(open_shard, 1)
    return warm_shard, warm_store, cold, how


def peak_rss_mib() -> float:
    """VmHWM of this process: unlike ru_maxrss it is not inherited from the parent across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_probe(store_dir: Path, rows: int) -> None:
    """Child process: peak RSS (MiB) before and after one search of 16 queries."""
    with VectorStore(store_dir, DIM, "float32", rows) as store:
        query = np.random.default_rng(5).standard_normal((16, DIM), dtype=np.float32)
        before = peak_rss_mib()
        search(store, query, 10, metric="cosine")
        after = peak_rss_mib()
    print(json.dumps({"before_mib": before, "after_mib": after}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the command")
    parser.add_argument("--rss-probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=SEARCH_ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_probe:
        rss_probe(args.rss_probe, args.rows)
        return 0
    search_rows = 40_000 if args.quick else SEARCH_ROWS
    recovery_rows = 200_000 if args.quick else RECOVERY_ROWS
    shutil.rmtree(BENCH_DIR, ignore_errors=True)
    BENCH_DIR.mkdir(parents=True)
    facts = machine.describe(BENCH_DIR)
    began = time.perf_counter()
    try:
        rows, notes = run(search_rows, recovery_rows)
    finally:
        shutil.rmtree(BENCH_DIR, ignore_errors=True)
    section = render_section(
        "Vector shards (bench/vectors.py)",
        "Durable append throughput, recovery (open) time, exact search latency and its memory "
        "for the vector shard store (docs/vectors.md).",
        machine.command_line(),
        time.perf_counter() - began,
        facts,
        rows,
        notes,
    )
    print(section)
    if not args.quick:
        write_section(DOC, "vectors", section)
    return 0


def run(search_rows: int, recovery_rows: int) -> tuple[list[Row], list[str]]:
    store_dir = BENCH_DIR / "store"
    mb = DIM * 4 / 1e6
    # (a) disk ceiling, then the store, same chunk size, same run
    rates, append_s, flushes = bench_append(store_dir, search_rows)
    chunk = max(BATCH * DIM * 4, int(statistics.median(flushes)) // 4096 * 4096)
    raw = [
        disk.write_bandwidth(BENCH_DIR / "raw.bin", chunk, min(search_rows * DIM * 4, 512 << 20))
        for _ in range(3)
    ]
    raw_mb = statistics.median(raw) / 1e6
    rows = [
        Row(
            "a append",
            f"disk pwrite+fdatasync MB/s ({chunk / 1e6:.0f} MB chunks: the median flush)",
            tuple(r / 1e6 for r in raw),
        ),
        Row("a append", f"rows/s (pages of {BATCH} x 384 f32, flush every 100 ms)", tuple(rates)),
        Row("a append", "MB per flush", tuple(f / 1e6 for f in flushes)),
        Row("a append", "MB/s payload", tuple(r * mb for r in rates)),
        Row(
            "a append",
            "% of disk bandwidth",
            tuple(r * mb / raw_mb for r in rates),
            percent=True,
            target=">= 50%",
            at_least=0.5,
        ),
    ]
    # (c) search over the rows just appended, warm page cache, against numpy in memory
    with VectorStore(store_dir, DIM, "float32", search_rows) as store:
        in_memory = np.concatenate([np.array(s.read(0, s.rows)[1]) for s in store.shards])
        rng = np.random.default_rng(9)
        one, sixteen = _batch(rng, 1), _batch(rng, 16)
        search(store, one, 10, metric="dot")  # warm the page cache
        for name, query in (("1 query", one), ("16 queries", sixteen)):
            base = timed(lambda q=query: np.argpartition(in_memory @ q.T, -10, axis=0)[-10:])
            dot = timed(lambda q=query: search(store, q, 10, metric="dot"))
            cos = timed(lambda q=query: search(store, q, 10, metric="cosine"))
            rows += [
                Row("c search", f"numpy matmul+argpartition in memory, {name}, s", tuple(base)),
                Row("c search", f"search dot, {name}, s", tuple(dot)),
                Row("c search", f"search cosine, {name}, s", tuple(cos)),
                Row(
                    "c search",
                    f"search dot / numpy, {name}",
                    tuple(d / statistics.median(base) for d in dot),
                    target="< 2x",
                    below=2.0,
                ),
            ]
    # (d) peak RSS of a search in a fresh process
    probe = subprocess.run(
        [*PROBE, str(store_dir), "--rows", str(search_rows)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    rss = json.loads(probe.stdout)
    store_mib = search_rows * DIM * 4 / (1 << 20)
    block_mib = 65536 * DIM * 4 / (1 << 20)
    rows += [
        Row("d memory", "peak RSS before search, MiB", (rss["before_mib"],)),
        Row(
            "d memory",
            "peak RSS growth during search, MiB",
            (rss["after_mib"] - rss["before_mib"],),
            target=f"< store ({store_mib:,.0f} MiB)",
            below=store_mib,
        ),
    ]
    shutil.rmtree(store_dir)
    # (b) recovery of a large float16 shard
    rec_dir = BENCH_DIR / "recovery"
    rec_dir.mkdir()
    free = shutil.disk_usage(BENCH_DIR).free
    fit = min(recovery_rows, int(free * 0.5) // (DIM * 2))
    built = build_recovery_shard(rec_dir, fit)
    warm_shard, warm_store, cold, how = bench_recovery(rec_dir)
    scale = f"{built:,} rows float16 ({built * DIM * 2 / 1e9:.1f} GB)"
    rows += [
        Row(
            "b recovery",
            f"Shard.open, warm, {scale}, s",
            tuple(warm_shard),
            target="< 1 s",
            below=1.0,
        ),
        Row(
            "b recovery",
            f"VectorStore open, warm, {scale}, s",
            tuple(warm_store),
            target="< 1 s",
            below=1.0,
        ),
        Row("b recovery", f"Shard.open, cold, {scale}, s", tuple(cold), target="< 1 s", below=1.0),
    ]
    notes = [
        f"(a) {search_rows:,} rows of 384 float32 appended in {append_s:.1f} s through "
        "VectorStore in pages of 4096 rows, flushed every 100 ms as the manager flushes "
        "(payload and ids written from the queued arrays without a joined copy, fdatasynced, "
        "then the journal record, fdatasynced; then the written pages are dropped from the "
        f"page cache); spread over {REPEAT} slices. Validation (the dtype, and "
        "a finite check by row sums) runs in append(); the rows are queued without a copy "
        "(copy=False, as the sink appends the array it gathered from a result page). Disk ceiling: bench/disk.py "
        "write_bandwidth (preallocated file, pwrite + fdatasync per chunk of the median flush "
        "size, pages dropped), 3 runs, same run, after the appends.",
        f"(c) search reads each shard through its memmap in blocks of 65536 rows, warm page "
        f"cache; the baseline is `data @ q.T` plus argpartition over the same {search_rows:,} "
        "rows already in a numpy array. k = 10.",
        f"(d) a fresh process opens the store and runs one cosine search of 16 queries; "
        f"ru_maxrss before and after. One block is {block_mib:.0f} MiB of float32.",
        f"(b) shard built with batches of 65536 rows, one flush each, stopped at "
        f"{RECOVERY_ROWS:,} rows, half the free disk or {RECOVERY_BUILD_S:.0f} s of building, "
        f"whichever came first: it holds {built:,} rows"
        + (
            ""
            if built >= RECOVERY_ROWS
            else f" ({built / RECOVERY_ROWS:.1%} of the 10 M target; the rows asked for were "
            f"{fit:,}, so {'the time budget' if built < fit else 'half the free disk'} "
            "set the size)"
        )
        + ". float16 rather than float32 (7.7 GB instead of 15 GB for 10 M rows). Open replays "
        "one journal record per flush, checks file sizes and re-checksums the last batch only, "
        f"so its cost does not grow with the payload size. Cold: {how}.",
    ]
    return rows, notes


if __name__ == "__main__":
    sys.exit(main())
