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

from dataclasses import dataclass, field

import numpy as np

from gpu.engines.base import EngineResult


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
