"""How a worker connects, what it asks for and which engine it runs: one home for all three
ways a worker starts.

| built by                            | from                                        |
|-------------------------------------|---------------------------------------------|
| `python run.py worker ...`          | `WorkerOptions.from_args` (flags: `add_arguments`) |
| a local worker of the supervisor    | `WorkerOptions.from_settings` (`[workers]`, `[[workers]]`) |
| a Ray actor of `run.py fleet`       | `WorkerOptions.of_group` (a `[[fleet]]` table's worker keys) |
| a test or benchmark launching one   | `WorkerOptions(...).argv()`: the flags that `from_args` reads back |

Defaults are `config/defaults.py`'s `[workers]` table. CURVE keys are not
flags of their own here: `run.py` adds `--key` / `--server-key` and passes
the loaded keys to `from_args`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from config.defaults import DEFAULTS
from config.settings import WorkerSettings
from config.stage_settings import WorkerStageSettings
from gpu.worker.faults import PHASES
from pipeline.transport.security import ClientCurve, internal_curve

_DEFAULTS = DEFAULTS["workers"]


@dataclass(frozen=True)
class WorkerOptions:
    """One worker's options (see the module docstring)."""

    broker: str
    model: str
    heartbeat: str | None = None
    batch_items: int = _DEFAULTS["batch_items"]
    batch_tokens: int = _DEFAULTS["batch_tokens"]
    prefetch: int = _DEFAULTS["prefetch"]
    drain_s: float = _DEFAULTS["drain_s"]
    target_batch_s: float = _DEFAULTS["target_batch_s"]
    batch_timeout_s: float = _DEFAULTS["batch_timeout_s"]  # 0: no watchdog
    curve: ClientCurve | None = (
        None  # CURVE keys for dispatch and heartbeat (pipeline/transport/security.py)
    )
    engine: str = "echo"  # a name of gpu/engines/registry.py
    engine_options: dict = field(default_factory=dict)  # make_engine's keyword options
    fault: str = ""  # tests: "PHASE[:N]", SIGKILL at the N-th PHASE (gpu/worker/faults.py)

    # ---- the command line ------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, engine: str | None = None) -> None:
        """The flags of `run.py worker` (all but the key options); `--engine` is required
        unless `engine` gives its default."""
        parser.add_argument(
            "--broker", required=True, help="dispatch address, e.g. tcp://host:7711"
        )
        parser.add_argument("--model", required=True, help="the model this worker serves")
        parser.add_argument(
            "--engine", required=engine is None, default=engine, help="echo, simulated, minilm, ..."
        )
        parser.add_argument("--option", action="append", help="engine option KEY=VALUE (repeat)")
        parser.add_argument(
            "--heartbeat", help="heartbeat address (default: the broker's port + 1)"
        )
        parser.add_argument(
            "--batch-items",
            type=int,
            default=_DEFAULTS["batch_items"],
            help="largest batch, in items",
        )
        parser.add_argument(
            "--batch-tokens",
            type=int,
            default=_DEFAULTS["batch_tokens"],
            help="largest batch, in tokens",
        )
        parser.add_argument(
            "--prefetch", type=int, default=_DEFAULTS["prefetch"], help="batches queued ahead"
        )
        parser.add_argument(
            "--drain-s", type=float, default=_DEFAULTS["drain_s"], help="grace period on SIGTERM"
        )
        parser.add_argument(
            "--target-batch-s",
            type=float,
            default=_DEFAULTS["target_batch_s"],
            help="size batches to take the engine about this long (0: always the maximum)",
        )
        parser.add_argument(
            "--batch-timeout-s",
            type=float,
            default=_DEFAULTS["batch_timeout_s"],
            help="a batch running longer means a hung engine: hand back and exit 7 (0: never)",
        )
        parser.add_argument(
            "--fault",
            default="",
            metavar="PHASE[:N]",
            help="for fault tests: SIGKILL this worker the N-th time (default 1) it reaches "
            f"PHASE, one of {', '.join(PHASES)}",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, curve: ClientCurve | None = None) -> WorkerOptions:
        """The options `add_arguments`' flags give; the heartbeat defaults to the broker's
        port + 1 on tcp."""
        heartbeat = args.heartbeat
        if heartbeat is None and args.broker.startswith("tcp://"):
            host, _, port = args.broker.rpartition(":")
            heartbeat = f"{host}:{int(port) + 1}"
        return cls(
            broker=args.broker,
            model=args.model,
            heartbeat=heartbeat,
            batch_items=args.batch_items,
            batch_tokens=args.batch_tokens,
            prefetch=args.prefetch,
            drain_s=args.drain_s,
            target_batch_s=args.target_batch_s,
            batch_timeout_s=args.batch_timeout_s,
            curve=curve,
            engine=args.engine,
            engine_options=engine_options(args.option or []),
            fault=args.fault,
        )

    def argv(self) -> list[str]:
        """The flags that give these options back through `from_args` (keys excepted: add
        `--key` and `--server-key` for a broker with keys)."""
        flags = ["--broker", self.broker, "--model", self.model, "--engine", self.engine]
        if self.heartbeat is not None:
            flags += ["--heartbeat", self.heartbeat]
        flags += [
            "--batch-items",
            str(self.batch_items),
            "--batch-tokens",
            str(self.batch_tokens),
            "--prefetch",
            str(self.prefetch),
            "--drain-s",
            repr(float(self.drain_s)),
            "--target-batch-s",
            repr(float(self.target_batch_s)),
            "--batch-timeout-s",
            repr(float(self.batch_timeout_s)),
        ]
        for key, value in self.engine_options.items():
            flags += ["--option", f"{key}={value}"]
        if self.fault:
            flags += ["--fault", self.fault]
        return flags

    # ---- a local worker ----------------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings: WorkerStageSettings) -> WorkerOptions:
        """A local worker's options, from its part of the broker's config
        (config/stage_settings.py): its group's table, the model's engine, the broker's own
        key, and its share of this host's cores for a CPU engine."""
        from pipeline.transport.topology import client_address  # the broker's host only

        threads = max(1, (os.cpu_count() or 1) // max(1, settings.local_workers))
        return cls.of_group(
            settings.group,
            settings.model,
            settings.model_engine,
            settings.model_tokenizer,
            threads,  # the cores shared among local workers
            broker=client_address(settings.dispatch.bind),
            heartbeat=client_address(settings.dispatch.heartbeat_bind),
            curve=internal_curve(settings),  # a local worker uses the broker's own key
        )

    @classmethod
    def of_group(
        cls,
        group: WorkerSettings,
        model: str,
        model_engine: str,
        model_tokenizer: str,
        threads: int,
        broker: str,
        heartbeat: str | None,
        curve: ClientCurve | None,
    ) -> WorkerOptions:
        """The options of a worker of `group` (a [workers] table, or a [[fleet]] table's
        worker keys): the group's engine, else the model's; a CPU engine on `threads` cores."""
        engine = group.engine or model_engine or "echo"
        options: dict = {}
        if engine == "simulated":
            options["tokens_per_s"] = group.simulated_tokens_per_s
        elif engine in ("minilm", "transformers"):
            options["threads"] = threads
        elif engine == "openai" and model_tokenizer:  # to carry the upstream's text
            options["tokenizer"] = model_tokenizer  # the model's own tokenizer
        options.update(group.options)
        return cls(
            broker=broker,
            model=model,
            heartbeat=heartbeat,
            batch_items=group.batch_items,
            batch_tokens=group.batch_tokens,
            prefetch=group.prefetch,
            drain_s=group.drain_s,
            target_batch_s=group.target_batch_s,
            batch_timeout_s=group.batch_timeout_s,
            curve=curve,
            engine=engine,
            engine_options=options,
        )


def engine_options(pairs: list[str]) -> dict:
    """`--option KEY=VALUE` flags -> make_engine's options: a number where VALUE is one
    (a float when it has a '.'), else the string."""
    options: dict = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = float(value) if "." in value else int(value)
        except ValueError:
            options[key] = value
    return options
