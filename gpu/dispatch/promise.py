"""A deadline promised or refused: before any line of a job is sent (`submit --deadline`,
an HTTP batch's `completion_window`), the broker's projection of its finish
(docs/completion.md, "Deadlines promised or refused").

The file's lines are counted per model (a line's `body.model`, an alias counted as its
model; lines that do not parse are left to the submit, which rejects them). Dispatch's
status answer gives each model's measured per-worker rate, its workers, its work left and
its jobs with a deadline; gpu/dispatch/demand.py `project_new` places the new job among
them in slack order. A job of several models finishes with its last one.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from config.settings import ModelSettings
from gpu.dispatch.demand import project_new
from pipeline.core.deadline_words import deadline_words


@dataclass(frozen=True)
class Promise:
    words: str  # "on track (projected 04:10)", "at risk (...)", "no projection: ..."
    at_risk: bool  # measured and late: what --deadline-strict refuses
    measured: bool = False  # a projection was made (a rate is measured for every model)
    finish_s: float | None = None  # the projected finish (wall seconds), when there is one


def lines_per_model(path: str | Path, models: Sequence[ModelSettings]) -> collections.Counter:
    """Lines of the file per [[models]] name (aliases folded in)."""
    names = {m.name: m.name for m in models}
    names.update({alias: m.name for m in models for alias in m.aliases})
    counts: collections.Counter = collections.Counter()
    with open(path, "rb") as lines:
        for line in lines:
            try:
                model = orjson.loads(line)["body"]["model"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if isinstance(model, str) and model in names:
                counts[names[model]] += 1
    return counts


def promise(
    info: dict[str, Any], counts: collections.Counter, deadline_s: float, priority: int
) -> Promise:
    """The answer for a job of `counts` lines per model due at `deadline_s`, from dispatch's
    status answer `info`."""
    now = time.time()
    rows = []
    for model, items in sorted(counts.items()):
        p = project_new(info, model, items, deadline_s, priority, now)
        rows.append(
            {
                "model": model,
                "deadline_s": deadline_s,
                "measured": p is not None,
                "projected_finish_s": None if p is None else p.finish_s,
                "at_risk": p is not None and p.at_risk,
                "workers": 0 if p is None else p.workers,
                "workers_to_finish": None if p is None else p.workers_to_finish,
            }
        )
    if not rows:
        return Promise("no projection: no line of the file names a model served here", False)
    unmeasured = [r for r in rows if not r["measured"]]
    if unmeasured:
        return Promise(deadline_words(unmeasured[0], now), False)
    worst = max(rows, key=lambda r: (r["at_risk"], r["projected_finish_s"] or float("inf")))
    return Promise(
        deadline_words(worst, now), bool(worst["at_risk"]), True, worst["projected_finish_s"]
    )
