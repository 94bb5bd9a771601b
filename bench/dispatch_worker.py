"""A timed worker for bench/dispatch.py: the SDK's `Worker`, instrumented, in its own process.

    python bench/dispatch_worker.py --broker ADDR --heartbeat ADDR --model M \
        --engine simulated --tokens-per-s 1000000 --batch-items 256 --prefetch 4 --stats OUT.json

Runs one `gpu.worker.session.Worker` (unchanged: `TimedWorker` only wraps
its message send and receive, and `TimedEngine` the engine's `run`) until
SIGTERM, drains as the SDK does, then writes one JSON object to `--stats`:

| key | meaning |
|---|---|
| `opened`, `first_work`, `stopped` | monotonic seconds (one clock for every process on the host): open, first WORK received, SIGTERM seen |
| `idle_s` | the SDK's own `Worker.idle_s` over the whole session (open to drain) |
| `idle_window_s` | the same measure between the first WORK and SIGTERM (the SDK's idle spells, clipped to that window): time with no batch queued or running |
| `engine_busy_s`, `engine_first`, `engine_last` | time inside `engine.run` between the first WORK and SIGTERM; first start, last end |
| `work_ms` | per WORK_REQUEST answered by WORK: milliseconds from the send of the request to the handling of the batch |
| `no_work_ms` | the same for requests answered by NO_WORK (nothing to hand out within the park time) |
| `completed` | items whose results the broker acknowledged |

A request and its answer are timed in this process with `time.perf_counter`
around the socket exchange: the request is timed from just after
`wire.send` returned, the answer when `Worker._handle` gets it, after the
network thread's poll. The SDK keeps one request outstanding at a time, so
requests and answers pair one to one.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.engines.base import Engine, EngineBatch, EngineResult
from gpu.engines.registry import make_engine
from gpu.worker.options import WorkerOptions
from gpu.worker.session import Worker
from pipeline.transport import wire

MT = wire.MessageType


class TimedEngine(Engine):
    """Another engine, with the wall time of each `run` recorded (start, end)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.runs: list[tuple[float, float]] = []

    def load(self) -> None:
        self.inner.load()

    def infer(self, batch: EngineBatch) -> EngineResult:
        started = time.monotonic()
        try:
            return self.inner.run(batch)
        finally:
            self.runs.append((started, time.monotonic()))


class TimedWorker(Worker):
    """`Worker` with each WORK_REQUEST -> WORK exchange and the idle time in a window timed."""

    def __init__(self, options: WorkerOptions, engine: TimedEngine) -> None:
        super().__init__(options, engine)
        self.asked_at: float | None = None
        self.work_ms: list[float] = []
        self.no_work_ms: list[float] = []
        self.opened = 0.0
        self.first_work: float | None = None
        self.idle_spells: list[tuple[float, float]] = []  # (start, end), as the SDK counted them

    def open(self) -> None:
        super().open()
        self.opened = time.monotonic()

    def _send(self, kind: MT, meta: dict, arrays: dict | None = None) -> bool:
        sent = super()._send(kind, meta, arrays)
        if sent and kind == MT.WORK_REQUEST:
            self.asked_at = time.perf_counter()
        return sent

    def _handle(self, message: wire.Message, now: float) -> None:
        kind = message.type
        if kind in (MT.WORK, MT.NO_WORK) and self.asked_at is not None:
            waited_ms = 1000 * (time.perf_counter() - self.asked_at)
            (self.work_ms if kind == MT.WORK else self.no_work_ms).append(waited_ms)
            self.asked_at = None
        if kind == MT.WORK and self.first_work is None:
            self.first_work = time.monotonic()
        super()._handle(message, now)

    def _track_idle(self, now: float) -> None:
        since = self._idle_since
        super()._track_idle(now)
        if since is not None and self._idle_since is None:  # the SDK just added a spell
            self.idle_spells.append((since, now))

    def idle_between(self, start: float, end: float) -> float:
        """Seconds of the SDK's idle spells inside [start, end]."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.idle_spells)


def stats(worker: TimedWorker, engine: TimedEngine, stopped: float) -> dict:
    first = worker.first_work
    inside = [(a, b) for a, b in engine.runs if first is not None and a >= first and a < stopped]
    return {
        "session": worker.session,
        "opened": worker.opened,
        "first_work": first,
        "stopped": stopped,
        "idle_s": worker.idle_s,
        "idle_window_s": worker.idle_between(first, stopped) if first is not None else None,
        "engine_busy_s": sum(min(b, stopped) - a for a, b in inside),
        "engine_first": inside[0][0] if inside else None,
        "engine_last": min(inside[-1][1], stopped) if inside else None,
        "batches": len(inside),
        "work_ms": worker.work_ms,
        "no_work_ms": worker.no_work_ms,
        "completed": worker.completed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    WorkerOptions.add_arguments(parser, engine="simulated")  # the flags of `run.py worker`
    parser.add_argument(
        "--tokens-per-s", type=float, default=1e6, help="the simulated engine's speed"
    )
    parser.add_argument("--stats", type=Path, required=True)
    parser.set_defaults(batch_items=256, batch_tokens=262_144, prefetch=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    options = WorkerOptions.from_args(args)
    engine_options = dict(options.engine_options)
    if options.engine == "simulated":
        engine_options.setdefault("tokens_per_s", args.tokens_per_s)
    engine = TimedEngine(make_engine(options.engine, **engine_options))
    worker = TimedWorker(options, engine)
    stop = {"at": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["at"] = stop["at"] or time.monotonic()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.open()
    try:
        code = worker.run(lambda: stop["at"] is not None)
    finally:
        worker.close()
    stopped = stop["at"] or time.monotonic()
    # Draining counts as busy in the SDK, so its first step closed the idle spell open at
    # SIGTERM (if any); spells are clipped to the window [first WORK, SIGTERM].
    record = stats(worker, engine, stopped)
    args.stats.write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    sys.exit(main())
