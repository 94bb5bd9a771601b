"""What every step of bench/ingest.py shares: the plan, the workload's constants, the outcome."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.store.segment_format import slot_bytes_for

TOKENS = 512  # per item
CHUNK_ITEMS = 4096  # items per SDK chunk (the broker's default)
SLOT_BYTES = slot_bytes_for(TOKENS * 4)  # 2080: 2048 token bytes and the item header
WINDOW = 8  # chunks in flight per producer
SEED = 20240611


@dataclass(frozen=True)
class Plan:
    root: Path  # this run's directory, removed at the end
    items: int  # per submit
    repeat: int
    text_lines: int
    profile: str  # auto | on | off
    notes: tuple[str, ...] = ()


@dataclass
class Outcome:
    """What a run found besides the table: pass/fail checks, method notes, the profile."""

    checks: list[tuple[str, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
