"""What a worker holds: one batch from WORK until its results are acknowledged.

| state         | meaning                                                        |
|---------------|----------------------------------------------------------------|
| `queued`      | waiting for the engine thread                                  |
| `running`     | the engine runs it                                             |
| `sent`        | results sent, kept until completion acknowledges them          |
| `handed_back` | given back to the broker (it leaves `Worker.held`)             |
| `dropped`     | skipped: none of its items is live any more                    |
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from gpu.engines.base import EngineResult
from gpu.work_protocol import ITEM_DTYPE, slot_key


@dataclass(eq=False)
class Held:
    batch_id: int
    items: np.ndarray  # ITEM_DTYPE
    lengths: np.ndarray
    tokens: np.ndarray
    task: str
    max_tokens: int
    sampling: dict = field(default_factory=dict)
    state: str = "queued"  # see the module docstring
    result_id: int = 0
    results: tuple | None = None  # (meta, arrays) while awaiting the ack
    sent_at: float = 0.0
    token: str = ""  # the work token WORK carried; returned with results and claims
    issued: np.ndarray | None = None  # the items as WORK carried them (the token covers them)
    gone: np.ndarray | None = None  # bool per item: no longer live (said at re-registration)
    engine_s: float = 0.0  # the seconds the engine ran it (RESULTS `engine_s`)

    def live_items(self) -> np.ndarray:
        """The items it holds that the broker has not said are gone."""
        return self.items if self.gone is None else self.items[~self.gone]


@dataclass
class Done:
    """What the engine thread says about one batch it ran."""

    batch_id: int
    outcome: str  # ok, transient, broken
    result: EngineResult | None = None
    reason: str = ""
    engine_s: float = 0.0  # the seconds the engine ran it


def live_items(batches: Iterable[Held]) -> np.ndarray:
    """The live items of all `batches`, in order (what REPORT and WORKER_HELLO say held)."""
    parts = [h.live_items() for h in batches]
    return np.concatenate(parts) if parts else np.zeros(0, ITEM_DTYPE)


def claims(batches: list[Held]) -> tuple[list[list], dict[str, np.ndarray]]:
    """What WORKER_HELLO claims for `batches`: [batch id, work token, items issued] each, and
    the arrays `held` (live items) and `issued` (the items as WORK carried them)."""
    issued = [h.items if h.issued is None else h.issued for h in batches]
    tokens = [[h.batch_id, h.token, len(i)] for h, i in zip(batches, issued, strict=True)]
    return tokens, {
        "held": live_items(batches),
        "issued": np.concatenate(issued) if issued else np.zeros(0, ITEM_DTYPE),
    }


def mark_gone(batches: list[Held], known: np.ndarray) -> list[Held]:
    """WELCOME's `known` (a flag per live item of `batches`, in order; 0: no longer live)
    marks each batch's gone items, never changing a batch: results for gone items are dropped
    when they come back. The batches with nothing live left."""
    held = live_items(batches)
    if len(known) != len(held) or not len(held):
        return []
    gone = slot_key(held[known == 0])
    empty = []
    for h in batches:
        drop = np.isin(slot_key(h.items), gone)
        if drop.any():
            h.gone = drop if h.gone is None else h.gone | drop
            if h.gone.all():
                empty.append(h)
    return empty
