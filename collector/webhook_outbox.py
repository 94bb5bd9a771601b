"""Durable, at-least-once delivery of webhook events: recorded before sent, retried until 2xx.

| path (under `<data_dir>/api/webhooks/` for batches, `<data_dir>/webhooks/` for CLI jobs) | what |
|-----------------------------------------|------|
| `pending/<event_id>.json`   | an event not yet answered 2xx: its receiver, body, attempts, next try |
| `delivered/<event_id>.json` | answered 2xx (moved here by the sender) |
| `failed/<event_id>.json`    | given up: no 2xx within `api.webhook_give_up_s` of its recording |

The batch driver (api/batch_events.py) or completion (collector/completion/job_webhooks.py)
records an event (`Outbox.record`, fsynced) when a batch or job ends; the sender
(`WebhookSender.step`, on its own thread in api-0 or completion) POSTs each due event, signed
(collector/webhooks.py), and on anything but a 2xx tries again after 1, 2, 4, ... s (at most
`MAX_RETRY_S` apart). A kill -9 at any moment loses nothing: a recorded event is sent again
by the next life with the same id (`webhook-id`), so a receiver drops duplicates by it. The
event id is made from the batch id, so recording again after a crash is a no-op.

`step(now)` reads no clock: the api stage passes `time.time()`, tests a fake clock.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from collector.webhooks import Webhooks, sign
from pipeline.store.durable import fsync_dir, write_whole

log = logging.getLogger(__name__)

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
SEND_EVERY_S = 0.2  # a sender thread looks for due events this often
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 300.0
ERROR_CHARS = 200  # of a receiver's answer kept as `last_error`


@dataclass
class Delivery:
    """One event and where its delivery stands (the JSON of its file)."""

    id: str
    owner: str
    url: str
    body: str  # the event, as POSTed
    recorded_at: float
    state: str = PENDING
    attempts: int = 0
    next_at: float = 0.0
    last_error: str | None = None
    ended_at: float | None = None

    def summary(self) -> dict[str, Any]:
        """What the Batch object shows of it (`fabric_webhook`, an extension)."""
        return {
            "id": self.id,
            "url": self.url,
            "status": self.state,
            "attempts": self.attempts,
            "last_error": self.last_error,
        }


class Outbox:
    """The events of one data dir (`<data_dir>/api/webhooks`)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "webhooks"
        for state in (PENDING, DELIVERED, FAILED):
            (self.dir / state).mkdir(parents=True, exist_ok=True)
        fsync_dir(self.dir)

    def _path(self, state: str, event_id: str) -> Path:
        return self.dir / state / f"{event_id}.json"

    def find(self, event_id: str) -> Delivery | None:
        return find_delivery(self.dir, event_id)

    def record(self, event: dict[str, Any], owner: str, url: str, now: float) -> bool:
        """Record `event` for `url`, durably, unless it is recorded already; True if new."""
        if self.find(event["id"]) is not None:
            return False
        body = orjson.dumps(event).decode()
        delivery = Delivery(event["id"], owner, url, body, recorded_at=now, next_at=now)
        write_whole(self._path(PENDING, delivery.id), orjson.dumps(asdict(delivery)))
        return True

    def pending(self) -> list[Delivery]:
        out = []
        for path in sorted((self.dir / PENDING).glob("*.json")):
            with contextlib.suppress(FileNotFoundError):
                out.append(Delivery(**orjson.loads(path.read_bytes())))
        return out

    def put(self, delivery: Delivery) -> None:
        """Save a delivery; one that ended moves from pending/ to its end state's folder."""
        write_whole(self._path(delivery.state, delivery.id), orjson.dumps(asdict(delivery)))
        if delivery.state != PENDING:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(PENDING, delivery.id))
            fsync_dir(self.dir / PENDING)

    def counts(self) -> dict[str, int]:
        return {
            s: sum(1 for _ in (self.dir / s).glob("*.json")) for s in (PENDING, DELIVERED, FAILED)
        }


def find_delivery(directory: Path, event_id: str) -> Delivery | None:
    """The event `event_id` in the outbox at `directory` (read only; None: not there)."""
    for state in (PENDING, DELIVERED, FAILED):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            return Delivery(**orjson.loads((directory / state / f"{event_id}.json").read_bytes()))
    return None


Post = Callable[[str, bytes, dict[str, str], float], int]


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST `body` to `url` (redirects not followed); the answer's status code."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        conn.request("POST", target, body=body, headers=headers)
        response = conn.getresponse()
        response.read(ERROR_CHARS)
        return response.status
    finally:
        conn.close()


class WebhookSender:
    """Sends each due pending event once per `step(now)`; counts the attempts."""

    def __init__(self, outbox: Outbox, webhooks: Webhooks, send: Post = post) -> None:
        self.outbox = outbox
        self.webhooks = webhooks
        self.send = send
        self.attempts = {"ok": 0, "error": 0}  # POSTs made by this life of the stage
        self.events = outbox.counts()  # events by state, kept up to date by `step`

    def step(self, now: float) -> int:
        """Try every pending event due at `now` (unix seconds); returns how many were tried."""
        tried = 0
        pending = self.outbox.pending()
        self.events[PENDING] = len(pending)
        for delivery in pending:
            if delivery.next_at <= now:
                self.attempt(delivery, now)
                tried += 1
                if delivery.state != PENDING:
                    self.events[PENDING] -= 1
                    self.events[delivery.state] += 1
        return tried

    def attempt(self, delivery: Delivery, now: float) -> None:
        secret = self.webhooks.secret(delivery.owner)
        body = delivery.body.encode()
        delivery.attempts += 1
        if secret is None:  # the owner's table was removed: nothing to sign with
            error: str | None = f"no [[api.webhooks]] table for owner {delivery.owner!r}"
        else:
            timestamp = int(now)
            headers = {
                "content-type": "application/json",
                "webhook-id": delivery.id,
                "webhook-timestamp": str(timestamp),
                "webhook-signature": sign(secret, delivery.id, timestamp, body),
            }
            try:
                status = self.send(delivery.url, body, headers, self.webhooks.timeout_s)
                error = None if 200 <= status < 300 else f"answered {status}"
            except (OSError, http.client.HTTPException) as exc:
                error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        self.attempts["ok" if error is None else "error"] += 1
        if error is None:
            delivery.state, delivery.ended_at, delivery.last_error = DELIVERED, now, None
        else:
            delivery.last_error = error
            if now - delivery.recorded_at >= self.webhooks.give_up_s:
                delivery.state, delivery.ended_at = FAILED, now
                log.warning(
                    "webhook %s to %s given up after %d attempts (api.webhook_give_up_s): %s",
                    delivery.id,
                    delivery.url,
                    delivery.attempts,
                    error,
                )
            else:
                wait_s = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (delivery.attempts - 1))
                delivery.next_at = now + wait_s
        self.outbox.put(delivery)


def sender_thread(sender: WebhookSender, stop: threading.Event) -> threading.Thread:
    """A started thread stepping `sender` on the wall clock until `stop` is set (a slow
    receiver holds up nothing else). A disk error (a full disk) is logged and tried again at
    the next step: the event stays pending."""

    def run() -> None:
        while not stop.is_set():
            try:
                sender.step(time.time())
            except OSError as exc:
                log.warning("webhooks: %s; trying again", exc)
            stop.wait(SEND_EVERY_S)

    thread = threading.Thread(target=run, name="webhooks", daemon=True)
    thread.start()
    return thread
