"""What the completion stage reports to the metrics (docs/metrics.md): results stored,
duplicates dropped, results delivered and refused, jobs stopped by a limit, worker-seconds,
full-disk episodes and webhook deliveries."""

from __future__ import annotations

from collector.completion.intake import ResultIntake
from collector.completion.result_check import CAUSES


def completion_figures(intake: ResultIntake, delivered: int, stopped: int, more: dict) -> dict:
    """The completion stage's figures by metric name (pipeline/telemetry/metric_catalogue.py):
    its intake's counts, results `delivered`, jobs `stopped` by a limit, and `more` (the
    full-disk and webhook figures)."""
    return {
        "fabric_items_completed_total": intake.stored,
        "fabric_duplicate_results_total": {
            (why.replace(" ", "_"),): n for why, n in intake.duplicates.items()
        },
        "fabric_results_delivered_total": delivered,
        "fabric_results_refused_total": {(c,): intake.refused[c] for c in CAUSES[1:]},
        "fabric_jobs_stopped_by_limit_total": stopped,
        "fabric_worker_seconds_total": round(intake.worker_time.added_s, 3),
        **(reuse_figures(intake.reuse) if intake.reuse is not None else {}),
        **more,
    }


def reuse_figures(reuse) -> dict:
    """Result reuse's figures (collector/completion/reuse.py)."""
    return {
        "fabric_items_reused_total": {(model,): n for model, n in reuse.reused.items()},
        "fabric_reuse_index_entries": reuse.writer.entries if reuse.writer is not None else 0,
    }
