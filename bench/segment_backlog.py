"""The backlog bench/segment.py recovers, and step 3: retiring its slots.

The backlog is a data dir of small (64-token) items left as a crashed writer
leaves it: the last segment never closed, and (for each recovery run) every
header's sealed word cleared. Step 3 retires random LIVE slots the way the
completion stage does: a batch of completions grouped by segment, one
Segment.tombstone call per segment, with or without the periodic sync.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from bench.report import Row
from bench.segment_items import open_appender, token_pool
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.store.segment_format import SEALED_OFFSET, slot_bytes_for

LANE = 64
SLOT_BYTES = slot_bytes_for(LANE * 4)
BUILD_BATCH_ITEMS = 1 << 16
TOMBSTONE_BATCH = 100_000
# (name, seconds between syncs or None for never, held to the target)
SYNC_POLICIES = (
    ("no sync", None, True),
    ("sync every 100 ms", 0.1, True),
    ("sync every batch", 0.0, False),
)
TARGET_PER_S = 5e6

Batch = list[tuple[int, np.ndarray]]  # (segment index, slots) per segment the batch touches


def build_backlog(root: Path, items: int, rng: np.random.Generator) -> float:
    """Append `items` 64-token items and stop without closing, as a crash would; seconds."""
    appender = open_appender(root, LANE, SLOT_BYTES)
    tokens = token_pool(rng, BUILD_BATCH_ITEMS, LANE, 1)[0]
    count = np.full(BUILD_BATCH_ITEMS, LANE, dtype=np.uint32)
    job = np.full(BUILD_BATCH_ITEMS, 7, dtype=np.uint64)
    index = np.arange(BUILD_BATCH_ITEMS, dtype=np.uint32)
    started = time.perf_counter()
    for first in range(0, items, BUILD_BATCH_ITEMS):
        n = min(BUILD_BATCH_ITEMS, items - first)
        seq = np.arange(first + 1, first + n + 1, dtype=np.uint64)
        appender.append(seq, job[:n], index[:n], count[:n], tokens[:n])
        appender.sync()
    seconds = time.perf_counter() - started
    if appender.current is not None:
        appender.current.close()  # left unsealed, like a writer that died
    return seconds


def unseal(data_dir: DataDir) -> None:
    """Clear every header's sealed word, as after a crash (recovery seals them again)."""
    for path in data_dir.segment_files():
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\0\0\0\0", SEALED_OFFSET)
            os.fdatasync(fd)
        finally:
            os.close(fd)


def completion_batches(sizes: list[int], rng: np.random.Generator) -> list[Batch]:
    """A random half of all slots, cut into batches of TOMBSTONE_BATCH, each grouped by segment."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    picks = rng.permutation(total)[: total // 2]
    batches = []
    for start in range(0, len(picks), TOMBSTONE_BATCH):
        chunk = picks[start : start + TOMBSTONE_BATCH]
        segment = np.searchsorted(offsets, chunk, side="right") - 1
        order = np.argsort(segment, kind="stable")
        chunk, segment = chunk[order], segment[order]
        cuts = np.flatnonzero(np.diff(segment)) + 1
        groups = zip(np.split(segment, cuts), np.split(chunk, cuts), strict=True)
        batches.append([(int(s[0]), c - offsets[s[0]]) for s, c in groups])
    return batches


def retire(segments: list[Segment], batches: list[Batch], sync_every_s: float | None) -> float:
    """Tombstone every batch, syncing touched segments every `sync_every_s` (None: never); seconds."""
    touched: set[int] = set()
    started = last_sync = time.perf_counter()
    for batch in batches:
        for index, slots in batch:
            segments[index].tombstone(slots)
            touched.add(index)
        now = time.perf_counter()
        if sync_every_s is not None and now - last_sync >= sync_every_s:
            _sync(segments, touched)
            last_sync = now
    if sync_every_s is not None:
        _sync(segments, touched)
    return time.perf_counter() - started


def _sync(segments: list[Segment], touched: set[int]) -> None:
    for index in sorted(touched):
        segments[index].sync()
    touched.clear()


def _restore(segments: list[Segment], saved: list[np.ndarray]) -> None:
    """Put every marker back as it was before a timed pass, and make that durable."""
    for segment, markers in zip(segments, saved, strict=True):
        segment.markers[:] = markers
        segment.write_counts(segment.entries, 0)
        segment.sync()


def retire_half(data_dir: DataDir, rng: np.random.Generator) -> None:
    """Retire a random half of the backlog, synced (untimed)."""
    segments = [Segment.open(path, writable=True) for path in data_dir.segment_files()]
    try:
        retire(segments, completion_batches([s.entries for s in segments], rng), 0.0)
    finally:
        for segment in segments:
            segment.close()


def bench_tombstone(data_dir: DataDir, repeat: int, rng: np.random.Generator) -> list[Row]:
    """Step 3: each policy retires a random half, `repeat` times; leaves half retired."""
    segments = [Segment.open(path, writable=True) for path in data_dir.segment_files()]
    sizes = [segment.entries for segment in segments]
    saved = [segment.markers.copy() for segment in segments]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in SYNC_POLICIES}
    calls = retired = 0
    try:
        for _ in range(repeat):
            for name, every_s, _ in SYNC_POLICIES:
                batches = completion_batches(sizes, rng)
                slots = sum(len(group) for batch in batches for _, group in batch)
                rates[name].append(slots / retire(segments, batches, every_s))
                calls, retired = calls + sum(len(batch) for batch in batches), retired + slots
                _restore(segments, saved)
    finally:
        for segment in segments:
            segment.close()
    retire_half(data_dir, rng)
    per_call = f"{TOMBSTONE_BATCH:,}-slot batches, ~{retired / calls:,.0f} per call"
    return [
        Row(
            "3 tombstone",
            f"slots/s, {name} ({per_call})",
            tuple(rates[name]),
            target=f">= {TARGET_PER_S / 1e6:.0f} M/s" if judged else "",
            at_least=TARGET_PER_S if judged else None,
        )
        for name, _, judged in SYNC_POLICIES
    ]


def notes(items: int, segments: int) -> list[str]:
    return [
        f"Backlog for steps 3-4: {items:,} items of {LANE} tokens ({SLOT_BYTES} B slots, "
        f"{segments} segments of 256 MiB), a small lane so that it fits a few GB.",
        f"Tombstone: each pass retires a random half of the backlog in batches of "
        f"{TOMBSTONE_BATCH:,}, grouped by segment before timing (grouping is the completion "
        f"stage's work), one Segment.tombstone call per segment a batch touches. Random order "
        f"dirties every marker page, the worst case for a sync. Markers are restored and "
        f"synced between passes; a last untimed pass leaves half retired for step 4.",
    ]
