"""The stage table: which stage classes a broker runs, how many of each, in stop order.

The one place that names every stage class (the supervisor on the ground floor
is handed this table; pipeline/transport/topology.py says what each stage reads and
writes). Stages are listed front first: the supervisor stops them in this
order, so work already accepted drains downstream, and local workers hand back
what they hold while dispatch and completion still run.
"""

from __future__ import annotations

from config.settings import Settings
from config.stage_settings import stage_settings
from pipeline.process.stage import StageSpec

# By reference: the supervisor imports none of them (pipeline/process/stage.py StageSpec)
FRONT = "ingest.front_stage:FrontStage"
TOKENIZER = "ingest.tokenizer_stage:TokenizerStage"
ROUTER = "router.router_stage:RouterStage"
WRITER = "router.writer_stage:WriterStage"
WORKER = "gpu.worker.worker_stage:WorkerStage"
DISPATCH = "gpu.dispatch.dispatch_stage:DispatchStage"
COMPLETION = "collector.completion.completion_stage:CompletionStage"
VECTORS = "collector.vectors.vector_stage:VectorStage"
API = "api.api_stage:ApiStage"  # fastapi: about 0.7 s of CPU, paid only when served


def stage_specs(settings: Settings) -> list[StageSpec]:
    """Every stage process of a broker with `settings`, front first, each with its own part
    of the settings (config/stage_settings.py)."""

    def spec(name: str, index: int, stage: str, critical: bool = True) -> StageSpec:
        return StageSpec(name, index, stage, stage_settings(settings, name, index), critical)

    specs = [spec("front", 0, FRONT)]
    specs += [spec("tokenizer", i, TOKENIZER) for i in range(settings.ingest.processes)]
    specs += [spec("router", i, ROUTER) for i in range(settings.router.processes)]
    specs += [spec("writer", i, WRITER) for i in range(settings.writers.processes)]
    local_workers = sum(group.local for group in settings.worker_groups)
    specs += [spec("worker", i, WORKER, critical=False) for i in range(local_workers)]
    specs.append(spec("dispatch", 0, DISPATCH))
    specs.append(spec("completion", 0, COMPLETION))
    specs.append(spec("vectors", 0, VECTORS))
    if settings.api.enabled:  # listed first: stopped first
        specs[:0] = [spec("api", i, API) for i in range(settings.api.processes)]
    return specs
