"""What a fleet controller decides, without Ray: how many workers each model needs, which
actor slots to start, which to drain and which to remove (assembly/ray_fleet.py does it).

Each `[[fleet]]` table (config/settings.py `FleetSettings`) has slots 0 .. max-1; an actor
is named after its model and slot (`actor_name`), so a controller started again finds the
actors of the one before it, and Ray refuses a second actor of one name: a slot never runs
two. One turn of the controller, per table:

| step            | rule                                                                    |
|-----------------|-------------------------------------------------------------------------|
| wanted          | the broker's `workers_needed` of the model (`workers_needed`), within min .. max |
| more wanted     | start actors at once in the lowest free slots (a draining slot is not free until its actor is gone) |
| fewer wanted    | once fewer have been wanted for `scale_down_s` without a break, drain the highest slots: each finishes its running batch and hands back the rest, as SIGTERM drains `run.py worker` |
| drained, failed | removed (`stopped`: it drained; `failed`: its engine broke or did not start, after handing back what it held); a failed slot starts again after `FAILED_PAUSE_S` |

An actor whose process dies (ray.kill, its node lost, the OOM killer) is restarted by Ray
(`max_restarts`), or, killed for good, its name is free and the next turn starts it again;
the items its session held come back through dispatch when the session times out, as for
any worker that vanishes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from config.settings import FleetSettings

log = logging.getLogger("fabric.fleet")
ACTOR_PREFIX = "fabric-worker"
FAILED_PAUSE_S = 5.0  # a slot whose engine failed starts again after this long
LIVE = ("pending", "starting", "running")  # an actor that serves, or will once placed
GONE = ("stopped", "failed")  # an actor that holds nothing more: remove it


def actor_name(model: str, slot: int) -> str:
    """The Ray name of a model's actor in `slot`: `fabric-worker:MODEL#SLOT`."""
    return f"{ACTOR_PREFIX}:{model}#{slot}"


def parse_name(name: str) -> tuple[str, int] | None:
    """(model, slot) of an actor name `actor_name` made; None for any other name."""
    head, _, slot = name.rpartition("#")
    prefix, _, model = head.partition(":")
    if prefix != ACTOR_PREFIX or not model or not slot.isdigit():
        return None
    return model, int(slot)


def workers_needed(status: dict, model: str) -> int:
    """The broker's `workers_needed` of `model` from `status --json` (dispatch's
    BROKER_INFO `demand`). A broker that reports no demand gives 1 while anything of the
    model is queued or held by a worker, else 0."""
    demand = status.get("demand")
    if isinstance(demand, dict):
        entry = demand.get(model)
        return int(entry.get("workers_needed", 0)) if isinstance(entry, dict) else 0
    queued = sum(q["queued"] for q in status.get("queues", ()) if q.get("model") == model)
    held = sum(w["batches"] for w in status.get("workers", ()) if w.get("model") == model)
    return 1 if queued or held else 0


@dataclass(frozen=True)
class Slot:
    """An actor found in the cluster: its slot, and its state (gpu/worker/hosted.py's, or
    `pending` while Ray has not placed it, `restarting` while Ray starts it again)."""

    slot: int
    state: str


@dataclass
class Plan:
    """What one turn does for one model: slots to start, to drain, to remove."""

    start: list[int] = field(default_factory=list)
    drain: list[int] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)


@dataclass
class ModelFleet:
    """One `[[fleet]]` table's controller state across turns: since when fewer actors have
    been wanted, and the slots whose engine failed, until when they wait."""

    settings: FleetSettings
    scale_down_s: float
    fewer_since: float | None = None
    paused_until: dict[int, float] = field(default_factory=dict)

    def wanted(self, needed: int) -> int:
        return max(self.settings.min, min(self.settings.max, needed))

    def plan(self, needed: int, slots: list[Slot], now: float) -> Plan:
        """The turn at `now` for the model's `needed` workers and the actors found."""
        plan = Plan()
        for s in slots:
            if s.state in GONE:
                plan.remove.append(s.slot)
                if s.state == "failed":
                    self.paused_until[s.slot] = now + FAILED_PAUSE_S
        live = sorted(s.slot for s in slots if s.state in (*LIVE, "restarting"))
        taken = {s.slot for s in slots}
        wanted = self.wanted(needed)
        if wanted >= len(live):
            self.fewer_since = None
            free = [
                slot
                for slot in range(self.settings.max)
                if slot not in taken and self.paused_until.get(slot, 0.0) <= now
            ]
            plan.start = free[: wanted - len(live)]
            return plan
        if self.fewer_since is None:
            self.fewer_since = now
        if now - self.fewer_since >= self.scale_down_s or len(live) > self.settings.max:
            plan.drain = live[wanted:]
            self.fewer_since = None
        return plan
