"""Typed, frozen settings: one object per section, one `Settings` holding them.

The fields carry no defaults: every value comes from `config.defaults`
merged with the file by `config.load.load_settings`, which validates before
it calls `build_settings`. Sequences are tuples, so a `Settings` is immutable
and hashable all the way down and can be handed to any stage as is.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.defaults import (
    BY_ENGINE,
    DEFAULTS,
    ENGINE_ENDPOINTS,
    FLEET_DEFAULTS,
    MODEL_DEFAULTS,
    SECTIONS,
)
from pipeline.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """[broker]: where durable state lives and how the input log is cut."""

    data_dir: str
    segment_bytes: int
    segment_min_bytes: int
    segment_idle_s: float
    lanes: tuple[int, ...]
    recovery_processes: int

    def lane_for(self, n_tokens: int) -> int | None:
        """Return the smallest lane edge >= `n_tokens`, or None if no lane holds it.

        A prompt of 0 tokens goes to the first lane. Raises ValueError for a
        negative count (a caller's bug, not a configuration problem).
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens = {n_tokens} is negative; a token count is >= 0")
        i = bisect.bisect_left(self.lanes, n_tokens)
        return self.lanes[i] if i < len(self.lanes) else None


@dataclass(frozen=True, slots=True)
class IngestSettings:
    """[ingest]: the producer-facing front and its tokenisers."""

    bind: str
    processes: int
    max_message_bytes: int
    chunk_items: int
    chunk_timeout_s: float
    max_chunks_in_flight: int
    producer_chunks_in_flight: int
    max_inflight_bytes: int
    producer_inflight_bytes: int
    max_connections: int
    max_peer_connections: int
    max_inputs_per_line: int
    max_line_tokens: int


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """[router]: processes assigning (model, shape, lane) to items."""

    processes: int


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """[writers]: segment writers and their group commit."""

    processes: int
    flush_ms: float
    drop_synced_pages: bool


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """[dispatch]: the single dispatch owner, leases and worker sessions."""

    bind: str
    heartbeat_bind: str
    lease_s: float
    session_timeout_s: float
    max_attempts: int
    report_s: float
    reregister_grace_s: float
    session_max_batches: int
    stall_batch_multiple: float
    stall_min_s: float
    demand_horizon_s: float
    compact_min_bytes: int
    max_message_bytes: int


@dataclass(frozen=True, slots=True)
class CompletionSettings:
    """[completion]: result persistence, tombstones and delivery."""

    bind: str
    processes: int
    tombstone_flush_ms: float
    results_retention_s: float
    page_items: int
    max_message_bytes: int
    reuse_retention_s: float = 30 * 86400.0
    reuse_max_bytes: int = 16 * 1024**3


@dataclass(frozen=True, slots=True)
class VectorSettings:
    """[vectors]: the vector shard manager (stores, flushes, searches)."""

    bind: str
    flush_ms: float
    shard_bytes: int
    dtype: str
    search_block_rows: int
    page_items: int


@dataclass(frozen=True, slots=True)
class CollectorSettings:
    """[collector]: removal of finished segment and completion files."""

    interval_s: float


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """[workers], or one [[workers]] table: worker processes started on this host for a model.

    `options` are engine keyword arguments as sorted (name, value) pairs (hashable).
    """

    local: int
    model: str
    engine: str
    options: tuple[tuple[str, Any], ...]
    simulated_tokens_per_s: float
    batch_items: int
    batch_tokens: int
    prefetch: int
    target_batch_s: float
    drain_s: float
    batch_timeout_s: float


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """One [[fleet]] table: Ray actors that run workers of one model (`run.py fleet`,
    docs/scaling.md), between `min` and `max` of them, each asking Ray for its resources;
    `worker` holds the keys it shares with a [[workers]] table (engine, options, batches)."""

    model: str
    min: int
    max: int
    num_gpus: float
    num_cpus: float
    accelerator_type: str
    worker: WorkerSettings  # `local` = 0: the actors are the workers


@dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """[supervisor]: restart policy and shutdown."""

    restart_backoff_s: float
    max_restarts: int
    restart_window_s: float
    stop_timeout_s: float


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """[metrics]: the supervisor's Prometheus endpoint and how often stages report."""

    bind: str
    interval_s: float


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """[api]: the OpenAI-compatible HTTP API stage (api/, docs/http-api.md)."""

    enabled: bool
    bind: str
    processes: int
    keys_file: str
    input_file_expiry_s: float
    max_upload_bytes: int
    max_header_bytes: int
    max_connections: int
    request_head_timeout_s: float
    keep_alive_timeout_s: float
    webhook_give_up_s: float
    webhook_timeout_s: float
    webhook_hosts: tuple[str, ...]
    webhooks: tuple[WebhookSettings, ...]  # [[api.webhooks]] tables


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """One [[api.webhooks]] table: where one owner's batch events go (collector/webhooks.py)."""

    owner: str
    url: str
    secret_file: str
    allow_batch_url: bool = False


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """[security]: CURVE keys of the broker and its clients (pipeline/transport/security.py uses them)."""

    server_key: str
    authorized_keys: str
    allow_insecure: bool
    client_key: str
    server_public_key: str

    @property
    def curve(self) -> bool:
        """True when the broker's ZeroMQ ports require CURVE (a server key is configured)."""
        return bool(self.server_key)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One [[models]] table: a model name, its engine and what it accepts."""

    name: str
    engine: str
    tokenizer: str
    max_tokens: int
    vocab_size: int  # 0 = from the tokenizer or the engine (ingest.catalog.vocab_size)
    endpoints: tuple[str, ...]
    aliases: tuple[str, ...] = ()  # other names input lines may give it (the output repeats them)
    revision: str = ""  # the weights as the operator declares them (result reuse's fingerprint)


@dataclass(frozen=True, slots=True)
class Settings:
    """The whole configuration, validated. Build it with `config.load_settings`.

    `data_path` is `broker.data_dir` made absolute against the working
    directory at load time (with `~` expanded), so a later `chdir` does not
    move the data. `source` names where the values came from (a file path or
    "<defaults>") for messages.
    """

    broker: BrokerSettings
    ingest: IngestSettings
    router: RouterSettings
    writers: WriterSettings
    dispatch: DispatchSettings
    completion: CompletionSettings
    vectors: VectorSettings
    collector: CollectorSettings
    workers: WorkerSettings  # [workers], or the first [[workers]] table
    supervisor: SupervisorSettings
    metrics: MetricsSettings
    api: ApiSettings
    security: SecuritySettings
    models: tuple[ModelSettings, ...]
    data_path: Path
    source: str
    worker_groups: tuple[WorkerSettings, ...]  # every model's local workers; none if local = 0
    fleet: tuple[FleetSettings, ...] = ()  # [[fleet]] tables: Ray actors (run.py fleet)

    def model(self, name: str) -> ModelSettings:
        """Return the model called `name`; raise ConfigError naming the known ones."""
        for model in self.models:
            if model.name == name:
                return model
        known = ", ".join(m.name for m in self.models)
        raise ConfigError(
            f"{self.source}: unknown model {name!r}; known models: {known}; "
            f"add a [[models]] table with name = {name!r} to serve it"
        )


_SECTION_TYPES: dict[str, type] = {
    "broker": BrokerSettings,
    "ingest": IngestSettings,
    "router": RouterSettings,
    "writers": WriterSettings,
    "dispatch": DispatchSettings,
    "completion": CompletionSettings,
    "vectors": VectorSettings,
    "collector": CollectorSettings,
    "workers": WorkerSettings,
    "supervisor": SupervisorSettings,
    "metrics": MetricsSettings,
    "api": ApiSettings,
    "security": SecuritySettings,
}


def _typed(default: Any, value: Any) -> Any:
    """Give `value` the Python type of its default: int -> float, list -> tuple."""
    if value and isinstance(value, list) and isinstance(value[0], dict):  # [[api.webhooks]]
        return tuple(WebhookSettings(**table) for table in value)
    if isinstance(default, float):
        return float(value)
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value


def build_workers(table: Mapping[str, Any]) -> WorkerSettings:
    """One [workers] table, or one [[workers]] table (`count` for `local`), over the defaults."""
    values = {**DEFAULTS["workers"], **table}
    if "count" in values:
        values["local"] = values.pop("count")
    return WorkerSettings(**{k: _typed(DEFAULTS["workers"][k], v) for k, v in values.items()})


def build_fleet(table: Mapping[str, Any]) -> FleetSettings:
    """One validated [[fleet]] table: its Ray keys over FLEET_DEFAULTS, the rest a
    [[workers]] table's (local = 0)."""
    ray = {k: _typed(v, table.get(k, v)) for k, v in FLEET_DEFAULTS.items() if k != "model"}
    rest = {k: v for k, v in table.items() if k not in FLEET_DEFAULTS}
    worker = build_workers({**rest, "model": table["model"], "local": 0})
    return FleetSettings(model=table["model"], worker=worker, **ray)


def build_model(table: Mapping[str, Any]) -> ModelSettings:
    """Build one model from a validated [[models]] table, filling in defaults."""
    values = {}
    for key, default in MODEL_DEFAULTS.items():
        if key in table:
            values[key] = _typed(default, table[key])
        elif default is BY_ENGINE:
            values[key] = tuple(ENGINE_ENDPOINTS[table["engine"]])
        else:
            values[key] = _typed(default, default)  # a list default as a tuple
    return ModelSettings(**values)


def build_settings(data: Mapping[str, Any], *, source: str, cwd: Path) -> Settings:
    """Build `Settings` from validated data shaped like `DEFAULTS` (every key present).

    The caller validates first (`config.validate.validate`); this function
    only converts types and resolves `data_path` against `cwd`.
    """
    sections = {
        name: _SECTION_TYPES[name](
            **{key: _typed(DEFAULTS[name][key], value) for key, value in data[name].items()}
        )
        for name in SECTIONS
        if name != "workers"
    }
    workers = data["workers"]
    if isinstance(workers, list):  # [[workers]]: one table per model
        groups = tuple(build_workers({"count": 1, **table}) for table in workers)
        sections["workers"] = groups[0] if groups else build_workers({"local": 0})
    else:
        sections["workers"] = build_workers(workers)
        groups = (sections["workers"],) if sections["workers"].local else ()
    data_path = (cwd / Path(data["broker"]["data_dir"]).expanduser()).resolve()
    return Settings(
        **sections,
        models=tuple(build_model(table) for table in data["models"]),
        data_path=data_path,
        source=source,
        worker_groups=groups,
        fleet=tuple(build_fleet(table) for table in data["fleet"]),
    )
