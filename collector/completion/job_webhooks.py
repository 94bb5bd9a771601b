"""Webhooks of CLI jobs (`run.py submit --notify URL`): the end of a job POSTed, signed.

A job submitted with `--notify` has the URL in its record (ingest/jobs.py). The completion
stage is where a job's end is known (collector/completion/finishing.py) and it runs in every
broker, with or without the HTTP API, so the event is recorded and sent here: `ended(view)`
records it (fsynced, `<data_dir>/webhooks/pending/`) before the job's `finished` mark is
written, so a kill between the two loses nothing (the next life finishes the job again and
recording again is a no-op: the event id is made from the job id). A sender thread POSTs it
with the retries and give-up of HTTP batches (collector/webhook_outbox.py).

The event is the one batches send (`batch.completed`, `batch.cancelled`, `batch.expired`;
`data.id` is the job id: a batch id is a job id too), signed with the secret of the
`[[api.webhooks]]` table of owner `cli`; a job whose URL is not allowed (beyond loopback and
not in `api.webhook_hosts`) gets none (the submit command refuses it first).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from collector.job_view import JobView
from collector.webhook_outbox import Outbox, WebhookSender, find_delivery, sender_thread
from collector.webhooks import Webhooks, event_id, url_problem
from config.settings import ApiSettings
from pipeline.core.job_states import JobState, openai_status
from pipeline.store.segment import disk_error

CLI_OWNER = "cli"  # the [[api.webhooks]] table whose secret signs CLI jobs' events


def end_state(view: JobView) -> JobState:
    """How a finishing job ended: cancelled (at its deadline: expired) or completed."""
    if view.cancelled:
        return JobState.EXPIRED if view.cancelled_at_deadline else JobState.CANCELLED
    return JobState.COMPLETED


def job_event(job_id: str, state: JobState, now_s: int) -> dict[str, Any]:
    return {
        "id": event_id(job_id),
        "object": "event",
        "type": f"batch.{openai_status(state)}",
        "created_at": now_s,
        "data": {"id": job_id},
    }


class JobWebhooks:
    """The outbox of CLI jobs' events and its sender thread."""

    def __init__(self, data_path: Path, api: ApiSettings, log: logging.Logger) -> None:
        self.webhooks = Webhooks(api)
        self.outbox = Outbox(data_path)
        self.api_outbox = data_path / "api" / "webhooks"  # batches' events (api/batch_events.py)
        self.sender = WebhookSender(self.outbox, self.webhooks)
        self.log = log
        self.stop = threading.Event()
        self.thread = sender_thread(self.sender, self.stop)

    def ended(self, view: JobView) -> None:
        """Record the end event of a finishing job that asked for one."""
        if not view.notify:
            return
        problem = url_problem(view.notify, self.webhooks.hosts)
        if problem:
            self.log.warning("job %s: --notify %s %s; no event", view.job_id, view.notify, problem)
            return
        now = time.time()
        event = job_event(view.job_id, end_state(view), int(now))
        try:
            self.outbox.record(event, CLI_OWNER, view.notify, now)
        except OSError as exc:  # a full disk: the job finishes at a later tidy, recording then
            raise disk_error(exc, self.outbox.dir, "recording the job's webhook event") from exc

    def delivery(self, job_id: str) -> dict[str, Any] | None:
        """Where the end event of a job (a CLI job's, or an HTTP batch's: api-0 sends those)
        stands, for `status JOB`; None when it has none."""
        found = find_delivery(self.outbox.dir, event_id(job_id)) or find_delivery(
            self.api_outbox, event_id(job_id)
        )
        return None if found is None else found.summary()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stats(self) -> dict[str, Any]:
        return {
            "fabric_webhooks_job_events": {(k,): v for k, v in self.sender.events.items()},
            "fabric_webhooks_job_attempts_total": {
                (k,): v for k, v in self.sender.attempts.items()
            },
        }

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
