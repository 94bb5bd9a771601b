"""Steps 1 and 2 of bench/segment.py: the disk's durable write bandwidth, and the log's.

The raw writer (bench/disk.py) and SegmentAppender write the same volume in
alternating slices, so the ratio between them is measured under the same
disk and memory conditions, which drift on a shared virtual disk.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import disk
from bench.report import Row
from bench.segment_items import MIB, open_appender, seconds_to_mb, token_pool
from pipeline.store.datadir import DataDir
from pipeline.store.segment_format import slot_bytes_for

LANE = 512
SLOT_BYTES = slot_bytes_for(LANE * 4)
BATCH_ITEMS = 1024
BIG_CHUNK_BYTES = 16 << 20
TOKEN_POOL = 16  # distinct pre-built token batches, reused in rotation
SLICE_BATCHES = 32  # batches per slice when the disk and the log alternate
TARGET_RATIO = 0.60


class DurableAppend:
    """The log's durable write path: SegmentAppender, one sync() per batch (group commit).

    `step(n)` appends and syncs the next n batches and returns the seconds
    spent, so the caller can interleave it with the raw disk writer; then,
    untimed, it drops the segments already rotated out from the page cache,
    as RawWriter drops what it wrote (see there).
    """

    def __init__(self, root: Path, pool: list[np.ndarray], batches: int) -> None:
        self._appender = open_appender(root, LANE, SLOT_BYTES)
        self._data_dir = DataDir(root)
        self._pool = pool
        n = len(pool[0])
        self._seq = np.arange(1, batches * n + 1, dtype=np.uint64).reshape(batches, n)
        self._job = np.full(n, 7, dtype=np.uint64)
        self._index = np.arange(n, dtype=np.uint32)
        self._count = np.full(n, LANE, dtype=np.uint32)
        self._next = 0
        self.timings: list[tuple[float, float]] = []  # (append s, sync s) per batch

    def step(self, n: int) -> float:
        started = time.perf_counter()
        for b in range(self._next, min(len(self._seq), self._next + n)):
            begun = time.perf_counter()
            tokens = self._pool[b % len(self._pool)]
            self._appender.append(self._seq[b], self._job, self._index, self._count, tokens)
            appended = time.perf_counter()
            self._appender.sync()
            self.timings.append((appended - begun, time.perf_counter() - appended))
            self._next = b + 1
        seconds = time.perf_counter() - started
        self._drop_rotated()
        return seconds

    def _drop_rotated(self) -> None:
        current = self._appender.current
        for path in self._data_dir.segment_files():
            if current is None or path != current.path:
                disk.drop_cached(path)

    def close(self) -> None:
        self._appender.close()


@dataclass
class Paired:
    """One repeat of steps 1 and 2: total seconds of each writer, and its per-batch timings."""

    disk_s: float = 0.0
    log_s: float = 0.0
    disk_chunks: list[float] = field(default_factory=list)  # seconds per chunk
    log_batches: list[tuple[float, float]] = field(default_factory=list)  # (append, sync)


def paired_repeat(root: Path, pool: list[np.ndarray], batches: int) -> Paired:
    """Raw disk and log in alternating (ABBA) slices of the same volume."""
    raw = disk.RawWriter(root / "raw", BATCH_ITEMS * SLOT_BYTES, batches)
    log = DurableAppend(root / "append", pool, batches)
    paired = Paired()
    try:
        for i, first in enumerate(range(0, batches, SLICE_BATCHES)):
            n = min(SLICE_BATCHES, batches - first)
            if i % 2 == 0:
                paired.disk_s += raw.write(n)
                paired.log_s += log.step(n)
            else:
                paired.log_s += log.step(n)
                paired.disk_s += raw.write(n)
        log.close()
    finally:
        raw.close()
    shutil.rmtree(root / "append")
    paired.disk_chunks, paired.log_batches = raw.timings, log.timings
    return paired


def bench_append(root: Path, batches: int, repeat: int, rng: np.random.Generator) -> list[Row]:
    """Steps 1 and 2: the disk at the batch size paired with the log, then the disk at 16 MiB."""
    pool = token_pool(rng, BATCH_ITEMS, LANE, TOKEN_POOL)
    volume = batches * BATCH_ITEMS * SLOT_BYTES
    paired_repeat(root, pool, batches)  # warm-up, not counted
    runs, big_bw = [], []
    for _ in range(repeat):
        runs.append(paired_repeat(root, pool, batches))
        big_bw.append(disk.write_bandwidth(root / "raw", BIG_CHUNK_BYTES, volume) / 1e6)
        os.sync()
    return [*_disk_rows(runs, big_bw, volume), *_log_rows(runs, volume)]


def _disk_rows(runs: list[Paired], big_bw: list[float], volume: int) -> list[Row]:
    chunk_ms = 1e3 * np.concatenate([run.disk_chunks for run in runs])
    size = f"{BATCH_ITEMS * SLOT_BYTES / MIB:.2f} MiB chunks"
    return [
        Row(
            "1 disk",
            f"pwrite+fdatasync, {size}, MB/s",
            seconds_to_mb(volume, [r.disk_s for r in runs]),
        ),
        Row("1 disk", "pwrite+fdatasync, 16 MiB chunks, MB/s", tuple(big_bw)),
        Row("1 disk", f"per chunk ({size}) p50, ms", (float(np.median(chunk_ms)),)),
        Row("1 disk", f"per chunk ({size}) p99, ms", (float(np.quantile(chunk_ms, 0.99)),)),
    ]


def _log_rows(runs: list[Paired], volume: int) -> list[Row]:
    """Throughput, the ratio to the disk, and where a batch's time goes (append vs sync)."""
    step, items = "2 append", volume // SLOT_BYTES
    log_s = [run.log_s for run in runs]
    ms = 1e3 * np.concatenate([np.array(run.log_batches) for run in runs])
    parts = {"append()": ms[:, 0], "sync()": ms[:, 1], "commit (append+sync)": ms.sum(axis=1)}
    disk_p50 = 1e3 * float(np.median(np.concatenate([run.disk_chunks for run in runs])))
    return [
        Row(step, "items/s (512 tokens each)", tuple(items / s for s in log_s)),
        Row(step, "tokens/s", tuple(items * LANE / s for s in log_s)),
        Row(step, f"MB/s of slot bytes ({SLOT_BYTES} B slots)", seconds_to_mb(volume, log_s)),
        Row(
            step,
            "ratio to disk at the same chunk (throughput, paired per repeat)",
            tuple(run.disk_s / run.log_s for run in runs),
            percent=True,
            target=f">= {TARGET_RATIO:.0%}",
            at_least=TARGET_RATIO,
        ),
        Row(
            step,
            "ratio at the median batch (disk chunk p50 / commit p50)",
            (disk_p50 / float(np.median(parts["commit (append+sync)"])),),
            percent=True,
        ),
        *[
            Row(step, f"per batch: {name} {label}, ms", (float(np.quantile(values, q)),))
            for name, values in parts.items()
            for label, q in (("p50", 0.5), ("p99", 0.99))
        ],
    ]


def notes(batches: int) -> list[str]:
    volume = batches * BATCH_ITEMS * SLOT_BYTES
    return [
        f"Steps 1 and 2: in each repeat the raw disk writer and the log each write "
        f"{volume / MIB:,.0f} MiB in alternating slices of {SLICE_BATCHES} batches (ABBA "
        f"order), so both see the same disk and memory conditions and the ratio is paired per "
        f"repeat; then the disk alone at 16 MiB chunks. One untimed warm-up repeat comes "
        f"first. Between slices, untimed, each writer drops what it has synced from the page "
        f"cache (the log: the segments it has rotated out), so memory is recycled as in a "
        f"broker in steady state. On a VM whose balloon hands free memory back to the host "
        f"(as here: virtio_balloon), the first touch of such a page costs ~2-3 ms per MiB, "
        f"more than the disk write. The disk "
        f"writer times only its writes (not posix_fallocate); the log's time includes "
        f"segment creation and rotation.",
        f"Append: {batches:,} batches of {BATCH_ITEMS} full 512-token items per repeat; "
        f"tokens come from {TOKEN_POOL} random batches built before timing and reused in "
        f"rotation (seq numbers stay distinct). MB/s counts slot bytes ({SLOT_BYTES} B per "
        f"item), not the marker and header pages each sync also writes. Per-batch times are "
        f"pooled over every batch of every repeat. append() (building slots in a buffer, "
        f"checksums, one pwrite, markers through the mapping) and sync() run one after the other, so the ratio is about "
        f"disk chunk time / (append + sync): the faster the disk at the time, the lower it is.",
    ]
