"""What the supervisor (pipeline/process/supervisor.py) runs for the floors above it, handed
to it by the composition root (assembly/broker.py): it names no upper floor itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.store.datadir import DataDir


@dataclass(frozen=True)
class Housekeeping:
    """What the supervisor runs for the floors above it; each may be left out (tests).

    `check_files(settings)`: before anything binds, raise ConfigError when a file the
    config names does not load (tokenizers). `after_recovery(data_dir, damaged, torn)`:
    when recovery found damage (or an earlier start left `losses-owed`), before any stage
    starts, isolate damaged input segments and give lost items their error results;
    returns the losses (each with `.line()`).
    `collector`: removes finished segment files (`offer(summaries)`, `step(now)`,
    `sweep(data_dir, retention_s)`; `next_step_s()`: when `step` has a retry due, or None).
    """

    check_files: Callable[[Any], None] | None = None
    after_recovery: Callable[[DataDir, list, int], list] | None = None
    collector: Any = None
