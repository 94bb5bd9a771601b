"""Each stage's own frozen part of the settings: the sections it reads, and nothing else.

    stage_settings(settings, "dispatch", 0)    # -> DispatchStageSettings
    FrontStage(stage_settings(settings, "front", 0), 0, epoch=epoch)

The stage table (assembly/stages.py) builds one for each stage process here, from the whole
`Settings`, and the supervisor hands it to that process: a stage cannot read a section it
was not given, and mypy says so where one tries. Fields keep the names they have in
`Settings` (`data_path`, `ingest`, `models`, ...), so helpers written for either take both
(the protocols of pipeline/transport/topology.py and `Catalogued` below).

Every one has `data_path` (logs, files, the ipc sockets) and `metrics` (how often the stage
reports, pipeline/telemetry/metrics.py), which `run_stage` uses for every stage. The
broker's epoch is not a setting: the supervisor passes it to each stage as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from config.settings import (
    ApiSettings,
    BrokerSettings,
    CompletionSettings,
    DispatchSettings,
    FleetSettings,
    IngestSettings,
    MetricsSettings,
    ModelSettings,
    RouterSettings,
    SecuritySettings,
    Settings,
    VectorSettings,
    WorkerSettings,
    WriterSettings,
)
from pipeline.core.errors import ConfigError


class Modelled(Protocol):
    """Settings that list the models: the whole `Settings`, or a stage's own that serves them."""

    @property
    def models(self) -> tuple[ModelSettings, ...]: ...


class Catalogued(Modelled, Protocol):
    """What the model catalog and the tokenisers read: the whole `Settings`, or the front's
    and the tokenizers' own."""

    @property
    def broker(self) -> BrokerSettings: ...
    @property
    def ingest(self) -> IngestSettings: ...


@dataclass(frozen=True, slots=True)
class EveryStage:
    """What every stage has: `data_path` (logs, files, the ipc sockets) and `metrics`."""

    data_path: Path
    metrics: MetricsSettings


@dataclass(frozen=True, slots=True)
class RingStage(EveryStage):
    """A stage on the ingest rings (front, tokenizer, router, writer): the ring layout reads
    the broker, ingest, router and writer sections (pipeline/transport/topology.py)."""

    broker: BrokerSettings
    ingest: IngestSettings
    router: RouterSettings
    writers: WriterSettings


@dataclass(frozen=True, slots=True)
class FrontStageSettings(RingStage):
    """The front (ingest/front_stage.py): producers, the job registry, the model catalog,
    and the rings to the routers (whose count the ring layout needs); the workers and fleet
    tables for the weights result reuse digests (ingest/weights_digest.py)."""

    security: SecuritySettings
    models: tuple[ModelSettings, ...]
    worker_groups: tuple[WorkerSettings, ...] = ()
    fleet: tuple[FleetSettings, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenizerStageSettings(RingStage):
    """A tokenizer (ingest/tokenizer_stage.py): the models' tokenisers and its rings."""

    models: tuple[ModelSettings, ...]


@dataclass(frozen=True, slots=True)
class RouterStageSettings(RingStage):
    """A router (router/router_stage.py): the lanes, and the rings in and out."""


@dataclass(frozen=True, slots=True)
class WriterStageSettings(RingStage):
    """A segment writer (router/writer_stage.py): segment sizes, group commit, its rings."""


@dataclass(frozen=True, slots=True)
class DispatchStageSettings(EveryStage):
    """Dispatch (gpu/dispatch/dispatch_stage.py): leases, sessions, its port's keys, and the
    models it reports queues for."""

    dispatch: DispatchSettings
    security: SecuritySettings
    models: tuple[ModelSettings, ...]


@dataclass(frozen=True, slots=True)
class CompletionStageSettings(EveryStage):
    """Completion (collector/completion/completion_stage.py); `max_attempts` is dispatch's,
    for the losses it words."""

    completion: CompletionSettings
    security: SecuritySettings
    max_attempts: int
    api: ApiSettings  # its [[api.webhooks]] table for owner "cli" signs `submit --notify` events


@dataclass(frozen=True, slots=True)
class VectorStageSettings(EveryStage):
    """The vector shard manager (collector/vectors/vector_stage.py), a client of completion."""

    vectors: VectorSettings
    security: SecuritySettings
    completion_bind: str


@dataclass(frozen=True, slots=True)
class ApiStageSettings(EveryStage):
    """The HTTP API (api/api_stage.py): a client of the front and of completion, which
    sweeps its own files every `sweep_interval_s` after `results_retention_s`."""

    api: ApiSettings
    security: SecuritySettings
    models: tuple[ModelSettings, ...]
    ingest_bind: str
    completion_bind: str
    results_retention_s: float
    sweep_interval_s: float
    dispatch_bind: str  # the demand and deadline projections (api/dispatch_view.py)


@dataclass(frozen=True, slots=True)
class WorkerStageSettings(EveryStage):
    """Local worker `index` (gpu/worker/worker_stage.py): its own [workers] group, the
    model it serves, where dispatch listens, the broker's key, and how many local workers
    share this host's cores. `source` names the config file, for its errors."""

    group: WorkerSettings
    model: str
    model_engine: str  # "" when no [[models]] table names the model
    model_tokenizer: str
    dispatch: DispatchSettings
    security: SecuritySettings
    local_workers: int
    source: str


StageSettings = (
    FrontStageSettings
    | TokenizerStageSettings
    | RouterStageSettings
    | WriterStageSettings
    | DispatchStageSettings
    | CompletionStageSettings
    | VectorStageSettings
    | ApiStageSettings
    | WorkerStageSettings
)


def worker_settings(settings: Settings, index: int) -> WorkerStageSettings:
    """Local worker `index`'s settings: local workers are numbered across the [[workers]]
    groups, in order."""
    for group in settings.worker_groups:
        if index < group.local:
            break
        index -= group.local
    else:
        raise ConfigError(f"{settings.source}: no local worker {index}")
    model = group.model or settings.models[0].name
    entry = next((m for m in settings.models if m.name == model), None)
    return WorkerStageSettings(
        data_path=settings.data_path,
        metrics=settings.metrics,
        group=group,
        model=model,
        model_engine=entry.engine if entry is not None else "",
        model_tokenizer=entry.tokenizer if entry is not None else "",
        dispatch=settings.dispatch,
        security=settings.security,
        local_workers=sum(g.local for g in settings.worker_groups),
        source=settings.source,
    )


def stage_settings(settings: Settings, stage: str, index: int = 0) -> StageSettings:
    """The settings of instance `index` of `stage` (a stage's `name`), from the whole config."""
    s = settings
    if stage == "front":
        return FrontStageSettings(
            s.data_path,
            s.metrics,
            s.broker,
            s.ingest,
            s.router,
            s.writers,
            s.security,
            s.models,
            s.worker_groups,
            s.fleet,
        )
    if stage == "tokenizer":
        return TokenizerStageSettings(
            s.data_path, s.metrics, s.broker, s.ingest, s.router, s.writers, s.models
        )
    if stage == "router":
        return RouterStageSettings(s.data_path, s.metrics, s.broker, s.ingest, s.router, s.writers)
    if stage == "writer":
        return WriterStageSettings(s.data_path, s.metrics, s.broker, s.ingest, s.router, s.writers)
    if stage == "dispatch":
        return DispatchStageSettings(s.data_path, s.metrics, s.dispatch, s.security, s.models)
    if stage == "completion":
        return CompletionStageSettings(
            s.data_path, s.metrics, s.completion, s.security, s.dispatch.max_attempts, s.api
        )
    if stage == "vectors":
        return VectorStageSettings(s.data_path, s.metrics, s.vectors, s.security, s.completion.bind)
    if stage == "api":
        return ApiStageSettings(
            s.data_path,
            s.metrics,
            s.api,
            s.security,
            s.models,
            ingest_bind=s.ingest.bind,
            completion_bind=s.completion.bind,
            results_retention_s=s.completion.results_retention_s,
            sweep_interval_s=s.collector.interval_s,
            dispatch_bind=s.dispatch.bind,
        )
    if stage == "worker":
        return worker_settings(settings, index)
    raise ValueError(f"no stage called {stage!r}")  # a caller's bug: the stage table names them
