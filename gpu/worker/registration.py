"""Registering with the broker: WORKER_HELLO until WELCOME, and knowing when to say it again.

| when                                      | what the worker does                          |
|-------------------------------------------|-----------------------------------------------|
| not registered, `next_try` reached        | WORKER_HELLO with what it holds (gpu/worker/session.py); the next try after the backoff times a jitter of 0.5 to 1.5, never past `HELLO_MAX_S`; the backoff doubles from `FIRST_HELLO_S` |
| no answer at all for `NO_ANSWER_WARN_S`   | says so once per silence, naming the address: keys are the usual cause |
| WELCOME                                   | registered: takes the broker's epoch and `report_s`; the backoff starts over |
| UNKNOWN_SESSION, or a heartbeat PONG with another epoch | the broker restarted: registers again at once |
| a heartbeat endpoint (`--heartbeat`)      | a PING every `report_s`                       |

Nothing here reads a clock: time is the `now` the session's `step` passes.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

from gpu.worker.connection import MAX_RECONNECT_S

log = logging.getLogger("fabric.worker")
HELLO_MAX_S = MAX_RECONNECT_S  # registering again: at most this long between tries, jitter included
FIRST_HELLO_S = 0.2  # the first pause between hellos (before jitter); it doubles
NO_ANSWER_WARN_S = 5.0  # registering this long without any answer: say so, and why it may be


class Registration:
    """Whether the session is registered, and when it says hello or pings next."""

    def __init__(self, jitter: Callable[[], float] = random.random) -> None:
        self.jitter = jitter  # 0 to 1: where in 0.5 to 1.5 times the backoff the next try falls
        self.registered = False
        self.epoch: int | None = None  # the broker life that welcomed this session
        self.report_s = 1.0  # told in WELCOME: how often to REPORT, and to ping
        self.backoff_s = FIRST_HELLO_S
        self.next_try = 0.0
        self.unanswered_since: float | None = None  # first HELLO since the broker last answered
        self.next_ping = 0.0

    def hello_due(self, now: float) -> bool:
        return not self.registered and now >= self.next_try

    def said_hello(self, now: float) -> float:
        """A HELLO was sent (or could not go): schedule the next try; its delay in seconds.
        Jittered, so a fleet does not stampede; never past HELLO_MAX_S, so a worker is back
        within a reregister_grace_s of its broker's return."""
        if self.unanswered_since is None:
            self.unanswered_since = now
        delay_s = min(HELLO_MAX_S, self.backoff_s * (0.5 + self.jitter()))
        self.next_try = now + delay_s
        self.backoff_s = min(HELLO_MAX_S, self.backoff_s * 2)
        return delay_s

    def silent_for(self, now: float) -> float | None:
        """How long registering has had no answer at all, once that passes NO_ANSWER_WARN_S
        (once per silence: the next answer starts a new one); else None."""
        since = self.unanswered_since
        if self.registered or since is None or now - since < NO_ANSWER_WARN_S:
            return None
        self.unanswered_since = math.inf  # said
        return now - since

    def heard(self) -> None:
        """The broker answered something: registering is not silent."""
        self.unanswered_since = None

    def welcomed(self, epoch: int, report_s: float) -> None:
        if self.epoch is not None and epoch != self.epoch:
            log.info("broker restarted (epoch %d -> %d)", self.epoch, epoch)
        self.epoch = epoch
        self.report_s = report_s
        self.registered = True
        self.backoff_s = FIRST_HELLO_S

    def again(self, now: float) -> None:
        """The broker restarted: register again, at once."""
        self.registered = False
        self.next_try = now

    def ping_due(self, now: float) -> bool:
        """Whether to PING now (then the next is due in `report_s`)."""
        if now < self.next_ping:
            return False
        self.next_ping = now + self.report_s
        return True

    def pong(self, epoch: object, now: float) -> None:
        """A heartbeat answer: another epoch than the one that welcomed us means register again."""
        if self.registered and self.epoch is not None and epoch != self.epoch:
            log.warning("heartbeat: broker epoch changed to %s; re-registering", epoch)
            self.again(now)

    def next_due(self, now: float, heartbeat: bool) -> float:
        """The next time a hello or a ping is due (inf: none)."""
        due = self.next_ping if heartbeat else math.inf
        return due if self.registered else min(due, self.next_try)
