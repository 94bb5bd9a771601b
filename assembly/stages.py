"""The stage table: which stage classes a broker runs, how many of each, in stop order.

The one place that names every stage class (the supervisor on the ground floor
is handed this table; pipeline/topology.py says what each stage reads and
writes). Stages are listed front first: the supervisor stops them in this
order, so work already accepted drains downstream, and local workers hand back
what they hold while dispatch and completion still run.
"""

from __future__ import annotations

from collector.completion.completion_stage import CompletionStage
from collector.vectors.vector_stage import VectorStage
from gpu.dispatch.dispatch_stage import DispatchStage
from gpu.worker.worker_stage import WorkerStage
from ingest.front_stage import FrontStage
from ingest.tokenizer_stage import TokenizerStage
from pipeline.stage import StageSpec
from router.router_stage import RouterStage
from router.writer_stage import WriterStage


def stage_specs(settings) -> list[StageSpec]:
    """Every stage process of a broker with `settings`, front first."""
    specs = [StageSpec("front", 0, FrontStage)]
    specs += [StageSpec("tokenizer", i, TokenizerStage) for i in range(settings.ingest.processes)]
    specs += [StageSpec("router", i, RouterStage) for i in range(settings.router.processes)]
    specs += [StageSpec("writer", i, WriterStage) for i in range(settings.writers.processes)]
    local_workers = sum(group.local for group in settings.worker_groups)
    specs += [StageSpec("worker", i, WorkerStage, critical=False) for i in range(local_workers)]
    specs.append(StageSpec("dispatch", 0, DispatchStage))
    specs.append(StageSpec("completion", 0, CompletionStage))
    specs.append(StageSpec("vectors", 0, VectorStage))
    if settings.api.enabled:  # listed first: stopped first
        from api.api_stage import ApiStage  # fastapi: about 0.7 s of CPU, paid only when served

        specs[:0] = [StageSpec("api", i, ApiStage) for i in range(settings.api.processes)]
    return specs
