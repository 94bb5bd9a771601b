"""The catalogue of every metric the broker exposes: its name, kind (counter, gauge,
histogram), labels, help, the process that reports it, and a histogram's buckets; with the
label values some of them take. A stage reports its figures by these names
(pipeline/telemetry/metrics.py); the supervisor serves them (metrics_hub.py,
metrics_server.py). docs/metrics.md describes each metric; a test keeps it in step with
this table.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
# Upper bounds of the fsync latency buckets, seconds (NVMe: ~0.1-2 ms; a slow disk: more).
FSYNC_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RECLAIM_CAUSES = (
    "lease_expired",  # the lease ran out without a report renewing it
    "session_lost",  # the worker's session went silent (disconnect, crash)
    "missing_from_report",  # the worker's report no longer lists the item
    "handed_back",  # the worker handed it back (transient failure, drain)
    "worker_left",  # the worker said BYE holding it
    "result_refused",  # completion refused its result (collector/completion/result_check.py)
    "stalled",  # its session held it with no results past the stall limit (gpu/dispatch/stall.py)
)
RESULT_REFUSALS = ("bad_status", "wrong_kind", "wrong_size", "wrong_dimension", "not_finite")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    labels: tuple[str, ...]
    help: str
    source: str  # the process that reports it: a stage name or "supervisor"
    buckets: tuple[float, ...] = ()
    carry: bool = True  # counters: earlier lives of the stage add to the series


def _catalogue(*metrics: Metric) -> dict[str, Metric]:
    return {m.name: m for m in metrics}


METRICS: dict[str, Metric] = _catalogue(
    # dispatch: queues
    Metric(
        "fabric_queued_items",
        GAUGE,
        ("model", "lane"),
        "Items in the input log waiting to be dispatched",
        "dispatch",
    ),
    Metric(
        "fabric_queued_tokens",
        GAUGE,
        ("model", "lane"),
        "Prompt tokens waiting to be dispatched, counted at the lane size (an upper bound)",
        "dispatch",
    ),
    Metric(
        "fabric_oldest_queued_item_age_seconds",
        GAUGE,
        ("model",),
        "Age of the oldest item waiting to be dispatched (0 when none waits)",
        "dispatch",
    ),
    Metric(
        "fabric_items_dispatched_total",
        COUNTER,
        ("model",),
        "Items handed out to workers (an item reclaimed and handed out again counts again)",
        "dispatch",
    ),
    Metric(
        "fabric_items_reclaimed_total",
        COUNTER,
        ("cause",),
        "Items taken back from a worker to be dispatched again, by cause",
        "dispatch",
    ),
    Metric(
        "fabric_dead_letters_total",
        COUNTER,
        (),
        "Items retired with an error after max_attempts reclaims",
        "dispatch",
    ),
    Metric(
        "fabric_quarantined_items_total",
        COUNTER,
        (),
        "Stored items that failed their checksum, retired with an error",
        "dispatch",
    ),
    Metric(
        "fabric_deadline_batches_total",
        COUNTER,
        (),
        "Batches handed out ahead of dispatch's usual order for a higher job priority or an "
        "earlier job deadline",
        "dispatch",
    ),
    Metric(
        "fabric_paused_jobs",
        GAUGE,
        (),
        "Jobs a client paused (run.py pause, POST /v1/batches/{id}/pause) that have not ended",
        "dispatch",
    ),
    Metric(
        "fabric_paused_items",
        GAUGE,
        (),
        "Queued items of paused jobs held back from workers (counted in fabric_queued_items)",
        "dispatch",
    ),
    Metric(
        "fabric_worker_messages_refused_total",
        COUNTER,
        ("what",),
        "Worker results or registration claims refused: no valid work token, or not registered",
        "dispatch",
    ),
    Metric(
        "fabric_damaged_segments",
        GAUGE,
        (),
        "Input segment files damaged: isolated at start, or found damaged since",
        "dispatch",
    ),
    Metric(
        "fabric_unretired_item_errors",
        GAUGE,
        (),
        "Item errors dispatch sent to completion that completion has not retired yet",
        "dispatch",
    ),
    # dispatch: demand (gpu/dispatch/demand_view.py; docs/dispatch.md, Demand and deadlines)
    Metric(
        "fabric_workers_needed",
        GAUGE,
        ("model",),
        "Workers that would do the model's pending work in time: every job with a deadline "
        "by it, the rest within dispatch.demand_horizon_s; at least 1 while any is pending or "
        "in flight, 0 when idle",
        "dispatch",
    ),
    Metric(
        "fabric_items_pending",
        GAUGE,
        ("model",),
        "Items waiting to be handed out (not on lease; paused jobs' items not counted)",
        "dispatch",
    ),
    Metric(
        "fabric_tokens_pending",
        GAUGE,
        ("model",),
        "Prompt tokens waiting to be handed out, counted at the lane size",
        "dispatch",
    ),
    Metric(
        "fabric_oldest_pending_age_seconds",
        GAUGE,
        ("model",),
        "How long the oldest pending item has waited (0 when none waits)",
        "dispatch",
    ),
    Metric(
        "fabric_worker_items_per_second",
        GAUGE,
        ("model",),
        "One worker's measured rate on the model, items per second of the time it held work "
        "(the mean over its workers; no series until measured)",
        "dispatch",
    ),
    Metric(
        "fabric_worker_tokens_per_second",
        GAUGE,
        ("model",),
        "One worker's measured rate on the model, lane-padded prompt tokens per second of "
        "the time it held work (no series until measured)",
        "dispatch",
    ),
    Metric(
        "fabric_jobs_at_risk",
        GAUGE,
        ("model",),
        "Jobs with a deadline whose projected finish, with the workers there are, is past it",
        "dispatch",
    ),
    # dispatch: workers (one series per worker session)
    Metric(
        "fabric_worker_sessions",
        GAUGE,
        ("model",),
        "Worker sessions registered with dispatch",
        "dispatch",
    ),
    Metric(
        "fabric_worker_stalled_sessions",
        GAUGE,
        ("model",),
        "Worker sessions holding batches with no results past the stall limit",
        "dispatch",
    ),
    Metric(
        "fabric_worker_in_flight_items",
        GAUGE,
        ("model", "session"),
        "Items out on lease with a worker session",
        "dispatch",
    ),
    Metric(
        "fabric_worker_leases",
        GAUGE,
        ("model", "session"),
        "Leases (batches) a worker session holds",
        "dispatch",
    ),
    Metric(
        "fabric_worker_prompt_tokens_total",
        COUNTER,
        ("model", "session"),
        "Prompt tokens of the batches the worker's engine finished (as it reports)",
        "dispatch",
        carry=False,
    ),
    Metric(
        "fabric_worker_engine_tokens_per_second",
        GAUGE,
        ("model", "session"),
        "The engine's measured speed while it computes, in lane-padded tokens per second",
        "dispatch",
    ),
    Metric(
        "fabric_worker_idle_seconds_total",
        COUNTER,
        ("model", "session"),
        "Time the worker had nothing queued or running: waiting for work (as it reports)",
        "dispatch",
        carry=False,
    ),
    Metric(
        "fabric_worker_engine_concurrency",
        GAUGE,
        ("model", "session"),
        "Requests the worker's engine may keep in flight to its upstream server now (the "
        "openai engine's adaptive limit, as it reports)",
        "dispatch",
    ),
    Metric(
        "fabric_worker_upstream_retries_total",
        COUNTER,
        ("model", "session"),
        "Requests the worker's engine sent its upstream server again after a 429, a 5xx or "
        "a connection fault (the openai engine, as it reports)",
        "dispatch",
        carry=False,
    ),
    # writers
    Metric(
        "fabric_items_appended_total",
        COUNTER,
        ("model", "lane"),
        "Items made durable in the input log (accepted work)",
        "writer",
    ),
    Metric(
        "fabric_writer_items_appended_total",
        COUNTER,
        ("writer",),
        "Items each writer process made durable: how the routers spread the work",
        "writer",
    ),
    Metric(
        "fabric_writer_fsync_seconds",
        HISTOGRAM,
        (),
        "Duration of one writer group commit: the fdatasync of every segment a step wrote",
        "writer",
        buckets=FSYNC_BUCKETS_S,
    ),
    # completion
    Metric(
        "fabric_items_completed_total",
        COUNTER,
        (),
        "Items whose result (or error result) was stored, each counted once",
        "completion",
    ),
    Metric(
        "fabric_duplicate_results_total",
        COUNTER,
        ("why",),
        "Results dropped because their item already had one, by why (sent_again, computed_again)",
        "completion",
    ),
    Metric(
        "fabric_results_refused_total",
        COUNTER,
        ("cause",),
        "Worker results that failed their check against their item, by cause",
        "completion",
    ),
    Metric(
        "fabric_items_reused_total",
        COUNTER,
        ("model",),
        "Lines of --reuse jobs that took the stored result of an identical earlier request "
        "instead of running, by model",
        "completion",
    ),
    Metric(
        "fabric_reuse_index_entries",
        GAUGE,
        (),
        "Results in the reuse index (0 until completion indexed one since its start)",
        "completion",
    ),
    Metric(
        "fabric_jobs_stopped_by_limit_total",
        COUNTER,
        (),
        "Jobs completion stopped because they passed one of their limits (error or token caps)",
        "completion",
    ),
    Metric(
        "fabric_worker_seconds_total",
        COUNTER,
        (),
        "Engine seconds of the results stored, from the workers' RESULTS (per job: status JOB)",
        "completion",
    ),
    Metric(
        "fabric_results_delivered_total",
        COUNTER,
        (),
        "Results marked delivered after a client acknowledged them",
        "completion",
    ),
    # every stage that writes durable state (pipeline/store/disk_full.py): writers, front, completion
    Metric(
        "fabric_disk_full",
        GAUGE,
        ("stage",),
        "1 while the stage is in a full-disk episode (its writes fail), else 0",
        "stages",
    ),
    Metric(
        "fabric_disk_full_episodes_total",
        COUNTER,
        ("stage",),
        "Full-disk episodes the stage went through (each said once in its log)",
        "stages",
    ),
    # vectors
    Metric("fabric_vector_rows", GAUGE, ("store",), "Durable rows in a vector store", "vectors"),
    Metric(
        "fabric_vector_rows_stored_total",
        COUNTER,
        (),
        "Embeddings the vector sink appended to stores",
        "vectors",
    ),
    Metric(
        "fabric_vector_flush_failures_total",
        COUNTER,
        (),
        "Scheduled vector flushes that failed (a full disk); nothing was acknowledged",
        "vectors",
    ),
    Metric(
        "fabric_vector_searches_total",
        COUNTER,
        (),
        "Searches the vector manager answered",
        "vectors",
    ),
    Metric(
        "fabric_vector_stores_unserved",
        GAUGE,
        (),
        "Vector stores that failed recovery and are not served",
        "vectors",
    ),
    # supervisor
    Metric(
        "fabric_stage_restarts_total",
        COUNTER,
        ("stage",),
        "Times the supervisor restarted a stage process after it died",
        "supervisor",
    ),
    Metric(
        "fabric_stage_up",
        GAUGE,
        ("stage",),
        "1 while the stage process runs, 0 while it is down",
        "supervisor",
    ),
    Metric(
        "fabric_stage_deaths_in_a_row",
        GAUGE,
        ("stage",),
        "Deaths of a local worker since it last ran restart_window_s without dying",
        "supervisor",
    ),
    Metric(
        "fabric_stage_restart_wait_seconds",
        GAUGE,
        ("stage",),
        "Seconds until the supervisor starts a dead local worker again (0 while it runs)",
        "supervisor",
    ),
    Metric(
        "fabric_segment_files",
        GAUGE,
        ("log",),
        "Segment files on disk, in the input or the completion log",
        "supervisor",
    ),
    Metric(
        "fabric_segment_bytes",
        GAUGE,
        ("log",),
        "Disk space the segment files take (allocated blocks)",
        "supervisor",
    ),
    Metric(
        "fabric_disk_free_bytes",
        GAUGE,
        (),
        "Free space on the file system of the data directory (for unprivileged users)",
        "supervisor",
    ),
    # the api stage (api/, docs/http-api.md)
    Metric(
        "fabric_api_requests_total",
        COUNTER,
        ("route", "method", "status"),
        "HTTP requests the api stage answered, by route template and status code",
        "api",
    ),
    Metric(
        "fabric_api_request_seconds_total",
        COUNTER,
        ("route", "method"),
        "Seconds the api stage spent answering requests, by route template",
        "api",
    ),
    Metric(
        "fabric_api_batches",
        GAUGE,
        ("status",),
        "Batches of the HTTP API by status (OpenAI's states)",
        "api",
    ),
    Metric(
        "fabric_webhooks_events",
        GAUGE,
        ("state",),
        "Webhook events of batch ends: pending, delivered, failed (given up)",
        "api",
    ),
    Metric(
        "fabric_webhooks_attempts_total",
        COUNTER,
        ("outcome",),
        "POSTs of webhook events: ok (a 2xx) or error (anything else, or no answer)",
        "api",
    ),
    Metric(
        "fabric_webhooks_job_events",
        GAUGE,
        ("state",),
        "Webhook events of CLI jobs' ends (submit --notify): pending, delivered, failed",
        "completion",
    ),
    Metric(
        "fabric_webhooks_job_attempts_total",
        COUNTER,
        ("outcome",),
        "POSTs of CLI jobs' webhook events: ok (a 2xx) or error",
        "completion",
    ),
)
