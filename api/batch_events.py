"""A batch's end as a webhook event: recorded in the outbox when the driver ends a batch.

The driver calls `ended(record, now)` after it wrote the batch's end status, and again for
each ended batch it first reads after a start: a kill between the two writes loses no event,
and recording is a no-op for an event already recorded (its id is made from the batch id).
A batch that ended longer than `api.webhook_give_up_s` ago (e.g. before webhooks were
configured) gets none.
"""

from __future__ import annotations

from typing import Any

from api.batch_record import BatchRecord
from collector.webhook_outbox import Outbox
from collector.webhooks import Webhooks, event_id


def batch_event(record: BatchRecord) -> dict[str, Any]:
    """OpenAI's event of a batch's end (`batch.completed`, `.failed`, `.expired`, `.cancelled`)."""
    return {
        "id": event_id(record.id),
        "object": "event",
        "type": f"batch.{record.status}",
        "created_at": record.stamp(record.status),
        "data": {"id": record.id},
    }


class BatchEvents:
    def __init__(self, outbox: Outbox, webhooks: Webhooks) -> None:
        self.outbox = outbox
        self.webhooks = webhooks

    def ended(self, record: BatchRecord, now: float) -> None:
        url = self.webhooks.url_for(record.owner, record.metadata)
        ended_at = record.stamp(record.status) or now
        if url is None or now - ended_at > self.webhooks.give_up_s:
            return
        self.outbox.record(batch_event(record), record.owner, url, now)
