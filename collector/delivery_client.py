"""The delivery client: one job's results fetched from completion, each page acknowledged only
once it is durable where it went (invariant 12).

Both consumers of results speak this protocol through one `Delivery` per job:
the results command (collector/results_client.py `ResultsClient.fetch`, which
writes OUT and ERR) and the vector sink (collector/vectors/sink.py, which
appends to stores).

1. `ask(now)` gives the FETCH to send, `{job, ack, req}` and the caller's
   fields (`limit`, `sink`, `all`, `cursors`), at most one in flight per job:
   none while a page waits to become durable, none before `next_at`, and the
   one in flight again (a resend, with a new `req`) only once `answer_timeout_s`
   passed without its answer.
2. `counts(meta)`: completion echoes `req` in its RESULT_PAGE; an answer to an
   older request (a resend crossed it) is dropped.
3. `written(page)`: the page's results went to their destination but are not
   durable yet; `durable(now)`: they are, and the next FETCH carries `ack` =
   that page, so completion marks its results delivered. A page that comes
   back (the client or completion restarted between a write and its ack) is
   written again; each destination skips what it already holds.
4. `done(meta, rows)`: an empty page of a job in a terminal state with nothing
   undelivered (or, for `all`, any terminal empty page) ends the delivery.

Asking ahead (the results command): `ahead(page, now)`, right after a page
arrives and before it is written, gives the FETCH for the next one, so that
completion reads it while this one is written and fsynced. That FETCH holds
the page (`hold`: page ids received and not acknowledged; completion leaves
their results out of the next page and keeps them outstanding) and acks only
what is already durable; the page's own ack goes with the FETCH after its
fsync. A page is still marked delivered only once durable: a client killed
with pages held and in flight leaves them undelivered, and its rerun gets
them again. Completion offers it with `ahead: true` in its RESULT_PAGE; from
an older completion (no `ahead`) the client asks one page at a time. With
`all` nothing is acknowledged: the next FETCH needs only the page's cursors,
and is asked ahead from any completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.core.job_states import is_terminal

ANSWER_TIMEOUT_S = 10.0  # a FETCH without an answer is sent again after this long


@dataclass
class Delivery:
    """One job's place in the delivery protocol; the caller sends and receives."""

    job_id: str
    extra: dict[str, Any] = field(default_factory=dict)  # fields of every FETCH (limit, sink)
    answer_timeout_s: float = ANSWER_TIMEOUT_S
    req: int = 0  # the FETCH whose answer counts
    sent_at: float | None = None  # that FETCH is unanswered since
    next_at: float = 0.0  # when to send the next FETCH
    ack: int = 0  # page to acknowledge with the next FETCH: its results are durable
    unflushed: int = 0  # page written, waiting to become durable
    cursors: list = field(default_factory=list)  # `all`: where the last page ended
    held: list[int] = field(default_factory=list)  # pages received, not yet durable (`hold`)
    sent_ack: int = 0  # the ack the FETCH in flight carries

    def ask(self, now: float) -> dict[str, Any] | None:
        """The FETCH to send now, or None (one in flight, a page not durable, not yet due)."""
        if self.unflushed:
            return None
        if self.sent_at is not None and now - self.sent_at < self.answer_timeout_s:
            return None
        if self.sent_at is None and now < self.next_at:
            return None
        return self._fetch(now)

    def ahead(self, page: dict[str, Any], now: float) -> dict[str, Any] | None:
        """The FETCH for the page after `page` (just received, not written yet), to send now
        while it is written; None when completion cannot keep a held page (no `ahead` in its
        RESULT_PAGE): then `ask` once it is durable."""
        if not (page.get("ahead") or self.extra.get("all")):
            return None
        if int(page.get("page") or 0):
            self.held.append(int(page["page"]))
        self.cursors = page.get("cursors", [])
        return self._fetch(now)

    def again(self, now: float) -> dict[str, Any]:
        """The FETCH in flight, sent again with a new `req` (its answer did not come)."""
        return self._fetch(now)

    def _fetch(self, now: float) -> dict[str, Any]:
        self.req += 1
        self.sent_at = now
        self.sent_ack = self.ack
        meta = {"job": self.job_id, "ack": self.ack, "req": self.req, **self.extra}
        if self.held:
            meta["hold"] = list(self.held)
        if self.extra.get("all"):
            meta["cursors"] = self.cursors
        return meta

    def counts(self, meta: dict[str, Any]) -> bool:
        """Whether a RESULT_PAGE answers the FETCH in flight (and take it if so)."""
        if meta.get("req") != self.req or self.sent_at is None:
            return False
        self.sent_at = None
        if self.ack == self.sent_ack:
            self.ack = 0  # completion has taken it (a page made durable since still waits)
        return True

    def written(self, meta: dict[str, Any]) -> None:
        """The page's results went where they go; `durable` makes them acknowledged."""
        self.unflushed = int(meta["page"])
        self.cursors = meta.get("cursors", [])

    def durable(self, now: float) -> None:
        """What was written is durable: the next FETCH, due at once, acknowledges it."""
        if self.unflushed:
            self.ack, self.unflushed = self.unflushed, 0
            if self.ack in self.held:
                self.held.remove(self.ack)
            self.next_at = now

    def durable_page(self, page: int, now: float) -> None:
        """Page `page`, asked ahead of and written, is durable (its fsync ran on a thread
        while the next page was written): the next FETCH acks it. Called once the FETCH that
        carried the previous ack has gone; an ack replaced before it went leaves its page's
        results undelivered, to come again (the files drop them)."""
        if not page:
            return  # `all`: nothing to acknowledge
        if page in self.held:
            self.held.remove(page)
        self.ack = page
        self.next_at = now

    def idle(self, now: float, poll_s: float) -> None:
        """Nothing new: ask again after `poll_s`."""
        self.next_at = now + poll_s

    def done(self, meta: dict[str, Any], rows: int) -> bool:
        """An empty page that ends the delivery: the job is terminal and nothing of it is
        left undelivered (with `all`: any terminal empty page, delivered or not)."""
        if rows or not is_terminal(meta.get("state")):
            return False
        return bool(self.extra.get("all")) or not meta.get("undelivered")
