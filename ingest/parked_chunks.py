"""Retried chunks the front holds after it alone restarted (ingest/front_stage.py).

A front killed alone leaves the router, writers and tokenizers behind it running, and
they may still hold the records of a chunk's try that the earlier front sent on, until
that try's deadline. A retry checked and reconciled before then would land as well, so
the retry waits here until the earlier try can no longer land (its `Landing` in the job's
journal, pipeline/store/job_files.py: the broker epoch, the front life and the deadline). A new
broker life starts with empty rings, and a front knows its own tries: neither waits.
"""

from __future__ import annotations

from ingest.inflight import DEADLINE_MARGIN_S
from pipeline.store.job_files import ChunkEntry
from pipeline.transport import wire


class ParkedChunks:
    """(job_no, chunk number) -> the latest message that sent it, and when it may go on."""

    def __init__(self, epoch: int, life: int) -> None:
        self.epoch = epoch  # this broker life's
        self.life = life  # this front process's
        self.waiting: dict[tuple[int, int], tuple[wire.Message, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.waiting

    def hold(
        self, key: tuple[int, int], earlier: ChunkEntry | None, message: wire.Message, now: float
    ) -> float | None:
        """Hold the chunk `key` sent by `message` if an earlier try may still land; returns
        how long it waits (None: it goes on now). Sent again while it waits, the latest
        sender is the one answered."""
        if key in self.waiting:
            until = self.waiting[key][1]
            self.waiting[key] = (message, until)
            return until - now
        landing = earlier.landing if earlier is not None else None
        if landing is None or landing.epoch != self.epoch or landing.life == self.life:
            return None
        until = landing.deadline_ns / 1e9 + DEADLINE_MARGIN_S  # writers drop records after it
        if until <= now:
            return None
        self.waiting[key] = (message, until)
        return until - now

    def due(self, now: float) -> list[wire.Message]:
        """The messages whose earlier try can no longer land, no longer held."""
        ready = [key for key, (_, until) in self.waiting.items() if until <= now]
        return [self.waiting.pop(key)[0] for key in ready]

    def next_s(self) -> float | None:
        """When the first of them may go on (None: none waits)."""
        return min((until for _, until in self.waiting.values()), default=None)
