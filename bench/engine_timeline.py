"""Where the pipeline's time goes against the engine alone: `bench/engine_overhead.py`'s timeline.

The pipeline's wall time, from the first submitted line to the last result
fsynced by the results client, splits into four parts, from the worker's own
record of the batches its engine ran (bench/batch_log_worker.py):

| part                     | what it is                                                  |
|--------------------------|-------------------------------------------------------------|
| (submit)                 | first submitted line -> the last one acknowledged (durable): overlaps the rest |
| start                    | first submitted line -> the engine starts its first batch (front, tokeniser, router, writer, dispatch) |
| engine                   | the sum of the engine's batch times in the pipeline          |
| gaps                     | the engine idle between two batches (the worker had none queued) |
| tail                     | the engine's last batch done -> the last result fsynced (completion, results client) |

Set against the engine alone (`engine_alone`'s seconds, same corpus, same
process of the bench), `engine - alone` is the engine slowed down in the
pipeline: the other processes' CPU taken from its cores, or other batches
than the bench's own (`batches`). Each part as a share of the pipeline's wall
time is what it costs the ratio; they add up to 100% - ratio.
"""

from __future__ import annotations

import numpy as np

BROKER = "broker stages and client"  # every process but the worker: what competes with it


def timeline(batches: dict, alone_s: float) -> dict[str, float]:
    """The four parts (module docstring) of one pipeline run, in seconds, with the engine
    alone's seconds and the engine's batches; `batches` is `pipeline()`'s record."""
    log = np.sort(batches["log"], order="began")
    ends = log["began"] + log["seconds"]
    wall = batches["ended"] - batches["began"]
    gaps = np.maximum(0.0, log["began"][1:] - ends[:-1]) if len(log) > 1 else np.zeros(0)
    return {
        "wall": wall,
        "submit": float(batches["submitted"] - batches["began"]),
        "start": float(log["began"][0] - batches["began"]),
        "engine": float(log["seconds"].sum()),
        "gaps": float(gaps.sum()),
        "largest gap": float(gaps.max()) if len(gaps) else 0.0,
        "tail": float(batches["ended"] - ends.max()),
        "alone": alone_s,
        "batches": float(len(log)),
        "items per batch": float(log["items"].mean()),
    }


def cost_shares(parts: dict[str, float]) -> dict[str, float]:
    """What each part costs the ratio, % of the pipeline's wall time: start, gaps, tail, and
    the engine's slowdown (engine in the pipeline - engine alone); their sum is 100 - ratio
    up to the overlap of the engine's batches (none: one engine thread)."""
    wall = parts["wall"]
    return {
        "start": 100 * parts["start"] / wall,
        "gaps": 100 * parts["gaps"] / wall,
        "tail": 100 * parts["tail"] / wall,
        "engine slower than alone": 100 * (parts["engine"] - parts["alone"]) / wall,
    }


def broker_cpu(cpu: dict[str, float]) -> dict[str, float]:
    """CPU seconds of the run by process, the worker apart and the rest summed (`BROKER`)."""
    out = dict(cpu)
    out[BROKER] = sum(v for k, v in cpu.items() if k != "worker-0")
    return out
