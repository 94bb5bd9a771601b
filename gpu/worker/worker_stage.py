"""A local worker: one `Worker` that the supervisor runs like a stage (`[workers] local = N`, or
one of a `[[workers]]` table's `count`), with its options from the broker's config. An engine
that cannot start (`EngineError` from its load) exits ENGINE_CANNOT_START after logging the
engine's message: the supervisor's report carries both, `status` shows them and `run.py batch`
stops on them (cli/batch.py)."""

from __future__ import annotations

import logging
import time
from typing import NoReturn

from config.stage_settings import WorkerStageSettings
from gpu.engines.base import EngineError
from gpu.engines.registry import EngineOptionsError, make_engine
from gpu.worker.options import WorkerOptions
from gpu.worker.session import Worker
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError
from pipeline.process.stage import Stage

log = logging.getLogger("fabric.worker")


class WorkerStage(Stage[WorkerStageSettings]):
    name = "worker"

    def __init__(self, settings: WorkerStageSettings, index: int, epoch: int = 0) -> None:
        super().__init__(settings, index, epoch)
        self.options = options = WorkerOptions.from_settings(settings)
        try:
            engine = make_engine(options.engine, **options.engine_options)
        except EngineOptionsError as exc:
            raise ConfigError(
                f"{settings.source}: the local workers of model {options.model!r}: {exc}; fix "
                "their options table"
            ) from None
        except EngineError as exc:  # not installed here, no model given
            self._cannot_start(exc)
        self.worker = Worker(options, engine)

    def open(self) -> None:
        try:
            self.worker.open()
        except EngineError as exc:  # the model, its options or the host: named in the message
            self._cannot_start(exc)

    def _cannot_start(self, exc: EngineError) -> NoReturn:
        log.error("%s: the engine cannot start: %s", self.label, exc)
        raise SystemExit(exitcodes.ENGINE_CANNOT_START) from None
        self.poller = self.worker.connection.poller  # its wait (run_stage adds its signal wake)

    def step(self, now: float) -> None:
        self.worker.step(now)
        if self.worker.exit_code is not None:
            raise SystemExit(self.worker.exit_code)

    def drain(self, deadline: float) -> None:
        self.worker.drain(time.monotonic() + self.options.drain_s)

    def close(self) -> None:
        self.worker.close()
