"""A worker session as dispatch sees it, and a work request waiting for work.

A session is one worker process, named by its random id, which is also its
ZeroMQ identity (docs/dispatch.md, sessions and leases). What the worker says
about itself in a REPORT (`worker_figures`) is kept for the metrics and the
status answer; nothing in dispatch's decisions depends on it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

PARK_S = 0.5  # a work request with nothing to give waits this long before NO_WORK


@dataclass
class Session:
    route: bytes
    model: str  # "" for a session reloaded from the dispatch file, not registered again yet
    last_seen: float  # monotonic: its last message
    handed_out: int = 0
    retired: int = 0
    started: float = -1.0  # when it registered (monotonic); last_seen when not given
    idle_s: float = 0.0  # the worker's own time waiting for work, from its last REPORT
    idle_marks: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=11)
    )  # (t, idle_s), one per rescan tick
    reported: dict = field(default_factory=dict)  # the worker's own figures from its last REPORT

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.last_seen


@dataclass
class Parked:
    """A WORK_REQUEST that found nothing: served when work comes, NO_WORK at `until`."""

    route: tuple[bytes, ...]
    session: str
    model: str
    max_items: int
    max_tokens: int
    until: float


# What a REPORT may say about the worker (docs/metrics.md): the first three from every worker,
# `concurrency` and `upstream_retries` from an engine that has them (gpu/engines/openai.py).
WORKER_FIGURES = ("prompt_tokens", "tokens_per_s", "idle_s", "concurrency", "upstream_retries")


def worker_figures(meta: dict) -> dict[str, float]:
    """What a worker's REPORT says about itself (`WORKER_FIGURES`; totals
    since the worker started); a missing or malformed figure is left out."""
    figures = {}
    for key in WORKER_FIGURES:
        value = meta.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and value >= 0:
            figures[key] = float(value)
    return figures
