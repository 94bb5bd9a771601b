"""Workers as a Ray fleet: `run.py fleet --ray ADDRESS --config FILE` (docs/scaling.md, "Ray").

The one module that imports Ray (the optional extra `pip install -e '.[ray]'`). Per
`[[fleet]]` table the controller keeps between `min` and `max` Ray actors, each a
`FleetActor`: the worker SDK's session (gpu/worker/hosted.py) with the table's engine,
asking Ray for the table's `num_gpus`, `num_cpus` and `accelerator_type`. What to start,
drain and remove each turn is assembly/fleet.py's; this module asks the broker and Ray.

| what                          | how                                                          |
|-------------------------------|--------------------------------------------------------------|
| how many workers a model needs | dispatch's status (`status --json`), its `demand` (`workers_needed`), every `interval_s` |
| an actor                      | named `fabric-worker:MODEL#SLOT` in `--namespace`, detached: it outlives its controller |
| the controller killed, started again | it lists the named actors of its namespace and adopts them; Ray refuses a second actor of a name (`get_if_exists`), so a slot never runs two |
| an actor's process dies       | Ray restarts it (`max_restarts = -1`): a new session; the old one's items come back through dispatch |
| an actor killed for good (`ray.kill`) | its name is free: the next turn starts its slot again   |
| scaling down                  | `drain()`: the session stops as SIGTERM stops `run.py worker`; removed once `stopped` |
| CURVE keys                    | read by the controller, sent to each actor with its options (they live in Ray's GCS) |
| the broker away               | nothing changes until it answers again                        |

Actors import this project from the controller's own tree (PYTHONPATH in their runtime
environment) where the node has it, else from the package installed on the node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from assembly.fleet import GONE, ModelFleet, Plan, Slot, actor_name, parse_name, workers_needed
from collector.results_client import DispatchClient
from config.settings import FleetSettings, Settings
from gpu.engines.base import EngineError
from gpu.engines.registry import make_engine
from gpu.worker.hosted import HostedWorker
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.core.errors import FabricError
from pipeline.transport.security import ClientCurve

log = logging.getLogger("fabric.fleet")
ROOT = Path(__file__).resolve().parents[1]  # the tree the actors import (module docstring)
STATE_WAIT_S = 2.0  # a turn waits this long for the actors' answers
DRAIN_WAIT_S = 120.0  # `--down` waits this long for the actors to drain


class FleetActor:
    """A Ray actor hosting one worker session (`ray.remote` makes it one: `FleetControl`)."""

    def __init__(self, options: WorkerOptions) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
        logging.getLogger("fabric").setLevel(logging.INFO)
        self.failure: dict | None = None
        self.hosted: HostedWorker | None = None
        try:
            engine = make_engine(options.engine, **options.engine_options)
        except EngineError as exc:  # a bad engine name or option: it waits to be removed
            log.error("engine %r cannot start: %s", options.engine, exc)
            self.failure = {"state": "failed", "exit_code": exitcodes.ENGINE_CANNOT_START}
            self.failure["reason"] = str(exc)
            return
        self.hosted = HostedWorker(options, engine)

    def state(self) -> dict:
        if self.hosted is None:
            return dict(self.failure or {})
        return self.hosted.state()

    def drain(self) -> str:
        return "failed" if self.hosted is None else self.hosted.drain()


@dataclass(frozen=True)
class Target:
    """Where the actors' workers connect and with which keys."""

    broker: str
    heartbeat: str | None
    curve: ClientCurve | None


class FleetControl:
    """The controller: one turn every `interval_s` (`run`), or `down` / `actors` once."""

    def __init__(
        self,
        settings: Settings,
        target: Target,
        namespace: str,
        scale_down_s: float,
        interval_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self.target = target
        self.namespace = namespace
        self.interval_s = interval_s
        self.fleets = {f.model: ModelFleet(f, scale_down_s) for f in settings.fleet}
        self.remote = ray.remote(FleetActor)
        self.asked: dict[str, ray.ObjectRef] = {}  # a state() not answered yet, per actor
        self.states: dict[str, dict] = {}  # each actor's last answer
        self.broker_away = False

    # ---- Ray ------------------------------------------------------------------------------
    def connect(self, address: str) -> None:
        try:
            ray.init(address=address, namespace=self.namespace, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FabricError(
                f"cannot join the Ray cluster at --ray {address} ({exc}); start one "
                "(`ray start --head`) or pass the address of its head, HOST:6379"
            ) from None

    def found(self) -> dict[str, tuple[str, int]]:
        """The fleet's actors in this namespace, by name: (model, slot)."""
        names = ray.util.list_named_actors()
        return {name: parsed for name in names if (parsed := parse_name(name)) is not None}

    def look(self, names: list[str]) -> dict[str, str]:
        """Each actor's state: its answer, `pending` while unplaced or busy, `dead` when
        Ray says it died (its name freed once Ray is done with it)."""
        for name in names:
            if name not in self.asked:
                handle = self._handle(name)
                if handle is not None:
                    self.asked[name] = handle.state.remote()
        waiting = [self.asked[n] for n in names if n in self.asked]
        if waiting:
            ray.wait(waiting, num_returns=len(waiting), timeout=STATE_WAIT_S)
        states: dict[str, str] = {}
        for name in names:
            ref = self.asked.get(name)
            if ref is None:
                states[name] = "dead"
                continue
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                states[name] = "pending"
                continue
            del self.asked[name]
            try:
                self.states[name] = ray.get(ref)
                states[name] = self.states[name]["state"]
            except RayActorError:
                states[name] = "dead"
        return states

    def _handle(self, name: str):
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:  # gone between the listing and now
            return None

    def start(self, fleet: FleetSettings, slot: int) -> None:
        model = self.settings.model(fleet.model)
        threads = max(1, int(fleet.num_cpus))
        options = WorkerOptions.of_group(
            fleet.worker,
            fleet.model,
            model.engine,
            model.tokenizer,
            threads,
            self.target.broker,
            self.target.heartbeat,
            self.target.curve,
        )
        resources: dict = {"num_gpus": fleet.num_gpus, "num_cpus": fleet.num_cpus}
        if fleet.accelerator_type:
            resources["accelerator_type"] = fleet.accelerator_type
        env = {"PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
        self.remote.options(
            name=actor_name(fleet.model, slot),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            runtime_env={"env_vars": env},
            **resources,
        ).remote(options)

    def drain(self, name: str) -> None:
        handle = self._handle(name)
        if handle is not None:
            handle.drain.remote()

    def remove(self, name: str) -> None:
        handle = self._handle(name)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        self.asked.pop(name, None)
        self.states.pop(name, None)

    # ---- the broker -----------------------------------------------------------------------
    def status(self) -> dict | None:
        """Dispatch's status, or None while the broker does not answer."""
        try:
            with DispatchClient(self.target.broker, 2.0, 1, self.target.curve) as client:
                status = client.broker_status()
        except FabricError as exc:
            if not self.broker_away:
                log.warning("the broker at %s does not answer (%s)", self.target.broker, exc)
            self.broker_away = True
            return None
        if self.broker_away:
            log.warning("the broker at %s answers again", self.target.broker)
        self.broker_away = False
        return status

    # ---- turns ----------------------------------------------------------------------------
    def turn(self, now: float) -> dict[str, Plan]:
        """One turn: look at the actors and the broker, start, drain and remove."""
        found = self.found()
        states = self.look(sorted(found))
        status = self.status()
        plans: dict[str, Plan] = {}
        for model in {m for m, _ in found.values()} - set(self.fleets):
            plans[model] = self._unlisted(model, found, states)
        for model, fleet in self.fleets.items():
            slots = [
                Slot(slot, states[name])
                for name, (m, slot) in found.items()
                if m == model and states[name] != "dead"
            ]
            if status is None:  # demand unknown: keep what runs, remove only what ended
                plan = Plan(remove=[s.slot for s in slots if s.state in GONE])
            else:
                needed = workers_needed(status, model)
                plan = fleet.plan(needed, slots, now)
                self._say(model, needed, slots, plan)
            self._act(fleet.settings, plan)
            plans[model] = plan
        return plans

    def _unlisted(self, model: str, found: dict, states: dict) -> Plan:
        """Actors of a model no [[fleet]] table names (the config changed): drain, remove."""
        plan = Plan()
        for name, (m, slot) in found.items():
            if m == model and states[name] in GONE:
                plan.remove.append(slot)
            elif m == model and states[name] in ("running", "starting"):
                plan.drain.append(slot)
        for slot in plan.drain:
            self.drain(actor_name(model, slot))
        for slot in plan.remove:
            self.remove(actor_name(model, slot))
        return plan

    def _act(self, fleet: FleetSettings, plan: Plan) -> None:
        for slot in plan.remove:
            name = actor_name(fleet.model, slot)
            state = self.states.get(name, {})
            if state.get("state") == "failed":
                log.error("actor %s failed: %s; it starts again", name, state.get("reason"))
            self.remove(name)
        for slot in plan.drain:
            self.drain(actor_name(fleet.model, slot))
        for slot in plan.start:
            self.start(fleet, slot)

    def _say(self, model: str, needed: int, slots: list[Slot], plan: Plan) -> None:
        if plan.start or plan.drain:
            live = sum(1 for s in slots if s.state not in (*GONE, "draining"))
            log.warning(
                "model %s: workers_needed %d, %d actor(s): starting slot(s) %s, draining %s",
                model,
                needed,
                live,
                plan.start,
                plan.drain,
            )

    def run(self, stop) -> int:
        """Turns until `stop()`; the actors stay (a controller started again adopts them)."""
        while not stop():
            began = time.monotonic()
            self.turn(began)
            pause_s = self.interval_s - (time.monotonic() - began)
            if pause_s > 0 and not stop():
                time.sleep(pause_s)  # a signal ends it: StopFlags' handler runs, stop() says so
        return exitcodes.OK

    def actors(self) -> list[dict]:
        """Every actor of the namespace with its last state (`run.py fleet --list`)."""
        found = self.found()
        states = self.look(sorted(found))
        return [
            {
                "name": name,
                "model": model,
                "slot": slot,
                **self.states.get(name, {}),
                "state": states[name],
            }
            for name, (model, slot) in sorted(found.items())
        ]

    def down(self, timeout_s: float = DRAIN_WAIT_S) -> int:
        """Drain every actor of the namespace and remove each once it stopped (`--down`)."""
        deadline = time.monotonic() + timeout_s
        drained: set[str] = set()
        while (found := self.found()) and time.monotonic() < deadline:
            for name, state in self.look(sorted(found)).items():
                if state in GONE or state == "dead":
                    self.remove(name)
                elif name not in drained and state != "pending":
                    self.drain(name)
                    drained.add(name)
            time.sleep(0.2)
        left = self.found()
        for name in left:  # out of time: what they held comes back through dispatch
            self.remove(name)
        return exitcodes.OK if not left else exitcodes.FAILED
