"""A full disk, as one stage sees it: one try a second while full, and two log lines.

A stage that writes durable state meets a full disk as `DiskFullError`
(ENOSPC or EDQUOT, translated by `pipeline.store.segment.disk_error`). It must not
exit for it (a restart frees nothing) and must not log once per message.
`FullDisk` is the small state machine such a stage keeps:

| call               | when                             | effect                                           |
|--------------------|----------------------------------|--------------------------------------------------|
| `ready(now)`       | before a write that may fail     | True when not full, or once per `retry_s` (one try) |
| `failed(exc, now)` | the write raised DiskFullError   | the first: one ERROR line; then a reminder every `remind_s` |
| `refused(n)`       | work turned away unwritten       | counted for the closing line                     |
| `succeeded(now)`   | a write went through             | writes are tried freely again                    |
| `settle(now)`      | now and then (each step)         | once nothing failed for `calm_s` after a success: one INFO line, the episode is over |
| `figures(label)`   | in the stage's `stats`           | `fabric_disk_full` (1 during an episode) and `fabric_disk_full_episodes_total` |

A disk that flaps (one write fits, the next does not) stays one episode:
one ERROR line when it fills, one INFO line once it has stayed writable.
Nothing in `FullDisk` sleeps or touches the disk; tests drive it with an
injected `now`. A stage whose last failed write may never be tried again
(the writer: a retried chunk whose items an earlier try already placed is
not appended again) tries `probe(directory)` when a retry is due, so the
episode ends once space is freed even with nothing more to write.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipeline.store.segment import disk_error

RETRY_S = 1.0
REMIND_S = 60.0
CALM_S = 10.0  # writable this long (no failure) before a full disk is said to be over


class FullDisk:
    """Whether the disk under one stage's files is full, and when to try it again."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        retry_s: float = RETRY_S,
        remind_s: float = REMIND_S,
        calm_s: float = CALM_S,
    ) -> None:
        self.log = log
        self.what = what  # what is held back while full, e.g. "results are left unacknowledged"
        self.retry_s = retry_s
        self.remind_s = remind_s
        self.calm_s = calm_s
        self.full = False  # the last write failed: writes are tried once per retry_s
        self.episode = False  # a full disk was announced and its end not yet
        self.episodes = 0  # announced since the stage started (a metric)
        self.since = 0.0  # when the episode began
        self.logged = 0.0  # when its last ERROR line was
        self.writable_since: float | None = None  # the first success after the last failure
        self.next_try = 0.0
        self.tries = 0
        self.turned_away = 0
        self.reason = "disk full"  # the last failure's message, for work turned away untried

    def ready(self, now: float) -> bool:
        """True if a write may be tried now: the disk is not known full, or a retry is due."""
        self.settle(now)
        if not self.full:
            return True
        if now >= self.next_try:
            self.next_try = now + self.retry_s
            return True
        return False

    def failed(self, exc: BaseException, now: float) -> None:
        """A write failed with DiskFullError: one ERROR line, then a reminder every `remind_s`."""
        self.tries += 1
        self.reason = str(exc)
        self.full = True
        self.writable_since = None
        self.next_try = now + self.retry_s
        if not self.episode:
            self.episode = True
            self.episodes += 1
            self.since = self.logged = now
            self.log.error(
                "disk full: %s; %s, retrying every %g s until space is freed",
                exc,
                self.what,
                self.retry_s,
            )
        elif now - self.logged >= self.remind_s:
            self.logged = now
            self.log.error(
                "disk still full after %.0f s (%d tries, %d turned away): %s",
                now - self.since,
                self.tries,
                self.turned_away,
                exc,
            )

    def refused(self, count: int = 1) -> None:
        """Work turned away unwritten while the disk is full (for the closing line)."""
        self.turned_away += count

    def succeeded(self, now: float) -> None:
        """A write went through: writes are tried freely again (the end is said once calm)."""
        self.full = False
        if self.episode and self.writable_since is None:
            self.writable_since = now
        self.settle(now)

    def settle(self, now: float) -> None:
        """End the episode once no write failed for `calm_s` since one went through: one INFO
        line (a disk that flaps between full and not stays one episode)."""
        if not self.episode or self.writable_since is None:
            return
        if now - self.writable_since < self.calm_s:
            return
        self.log.info(
            "disk writable again after %.1f s (failed tries: %d, turned away: %d)",
            self.writable_since - self.since,
            self.tries,
            self.turned_away,
        )
        self.episode = False
        self.writable_since = None
        self.tries = self.turned_away = 0

    def figures(self, label: str) -> dict:
        """This stage's full-disk metrics (docs/metrics.md), `label` its stage label."""
        return {
            "fabric_disk_full": {(label,): int(self.episode)},
            "fabric_disk_full_episodes_total": {(label,): self.episodes},
        }


def probe(directory: Path, name: str) -> None:
    """Write, sync and remove one page in `directory`; DiskFullError if there is no room."""
    path = directory / f".{name}.probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(4096))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise disk_error(exc, path, "writing a probe page") from exc
    finally:
        path.unlink(missing_ok=True)
