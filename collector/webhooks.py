"""Where a batch's end event goes, and how it is signed (Standard Webhooks, as OpenAI signs).

Each `[[api.webhooks]]` table names an owner (a keys_file owner, `local` without keys), the
receiver's `url` and a `secret_file` holding `whsec_<base64 key>`. A batch whose metadata has
`fabric_webhook_url` goes there instead, when its owner's table says `allow_batch_url = true`.
A receiver must be on loopback unless its host is in `api.webhook_hosts`. CLI jobs
(`submit --notify URL`, collector/completion/job_webhooks.py) are signed with the secret of
the table of owner `cli`. This module and the outbox live in collector/ so that both the api
stage and the completion stage send with them.

The event is OpenAI's (`{id, object: "event", type: "batch.<status>", created_at, data: {id}}`);
each POST carries `webhook-id` (the event id, the same on every retry), `webhook-timestamp`
(unix seconds of this POST) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"id.timestamp.body">` keyed with the decoded secret, which `openai`'s
`client.webhooks.unwrap()` verifies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from config.settings import ApiSettings, WebhookSettings
from pipeline.core.errors import ConfigError

URL_KEY = "fabric_webhook_url"  # metadata extension: this batch's receiver
SECRET_PREFIX = "whsec_"


def event_id(batch_id: str) -> str:
    """The event of a batch's end: one per batch, the same however often it is recorded."""
    return "evt_" + hashlib.sha256(f"batch-end\0{batch_id}".encode()).hexdigest()[:32]


def read_secret(path: str, where: str) -> bytes:
    """The HMAC key of a `whsec_` secret file; ConfigError names the file and the fix."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{where} = {path!r} cannot be read: {exc.strerror}; write the receiver's "
            f"whsec_ secret in it (e.g. printf 'whsec_%s' \"$(head -c 32 /dev/urandom | base64)\")"
        ) from exc
    try:
        if not text.startswith(SECRET_PREFIX):
            raise ValueError
        return base64.b64decode(text.removeprefix(SECRET_PREFIX), validate=True)
    except (ValueError, binascii.Error):
        raise ConfigError(
            f"{where} = {path!r} does not hold a whsec_<base64> secret; write one in it "
            f"(e.g. printf 'whsec_%s' \"$(head -c 32 /dev/urandom | base64)\")"
        ) from None


def url_problem(url: str, hosts: tuple[str, ...]) -> str | None:
    """Why a receiver URL is refused (not http(s), or a host beyond loopback not allowed)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "is not an http:// or https:// URL with a host"
    host = parts.hostname
    if host in hosts or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"names host {host!r}, beyond loopback; receivers are on loopback unless their host "
        "is listed in api.webhook_hosts"
    )


def sign(secret: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header of one POST."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret, signed, hashlib.sha256).digest()).decode()


@dataclass(frozen=True)
class Receiver:
    url: str
    secret: bytes
    allow_batch_url: bool


class Webhooks:
    """The owners' receivers from `[api]`, their secrets read once at start."""

    def __init__(self, api: ApiSettings) -> None:
        self.hosts = api.webhook_hosts
        self.give_up_s = api.webhook_give_up_s
        self.timeout_s = api.webhook_timeout_s
        self.receivers = {t.owner: self._receiver(i, t) for i, t in enumerate(api.webhooks)}

    def _receiver(self, i: int, table: WebhookSettings) -> Receiver:
        problem = url_problem(table.url, self.hosts)
        if problem:
            raise ConfigError(
                f"api.webhooks[{i}].url = {table.url!r} {problem}; name a receiver on this "
                "host, or list its host in api.webhook_hosts"
            )
        secret = read_secret(table.secret_file, f"api.webhooks[{i}].secret_file")
        return Receiver(table.url, secret, table.allow_batch_url)

    def url_for(self, owner: str, metadata: dict[str, str] | None) -> str | None:
        """Where the end of a batch of `owner` with `metadata` goes (None: nowhere)."""
        receiver = self.receivers.get(owner)
        if receiver is None:
            return None
        chosen = (metadata or {}).get(URL_KEY)
        if chosen and receiver.allow_batch_url and url_problem(chosen, self.hosts) is None:
            return chosen
        return receiver.url

    def batch_url_problem(self, owner: str, metadata: dict[str, str] | None) -> str | None:
        """Why a batch's `fabric_webhook_url` is refused at create (None: fine or not set)."""
        chosen = (metadata or {}).get(URL_KEY)
        if chosen is None:
            return None
        receiver = self.receivers.get(owner)
        if receiver is None or not receiver.allow_batch_url:
            return (
                f"metadata {URL_KEY} = {chosen!r} is not allowed for owner {owner!r}; its "
                "[[api.webhooks]] table needs allow_batch_url = true"
            )
        problem = url_problem(chosen, self.hosts)
        return f"metadata {URL_KEY} = {chosen!r} {problem}" if problem else None

    def secret(self, owner: str) -> bytes | None:
        receiver = self.receivers.get(owner)
        return None if receiver is None else receiver.secret
