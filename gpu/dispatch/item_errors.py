"""Items that leave dispatch without a result: sent to completion as ITEM_ERRORS until retired.

Dead letters (reclaimed `max_attempts` times), quarantined items (their slot
failed its checksum) and the queued items of a cancelled job are sent once,
and nothing else holds them (invariants 3 and 14): they are kept here until
completion's RETIRED names their slots, and sent again every
ITEM_ERRORS_RESEND_S until it does (completion lost them to a kill before they
were durable; it drops what it already has). Dead letters and quarantined items
are also counted and kept as recent events, one per job, for the status answer.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np

from gpu.dispatch.batch import Outcome
from gpu.work_protocol import slot_key
from pipeline.core import item_seq
from pipeline.core.item_error_codes import ItemErrorCode

ITEM_ERRORS_RESEND_S = 5.0  # item errors not seen retired this long after sending go again
RECENT_DEAD_LETTERS = 20  # dead-letter events kept for BROKER_STATUS


class ItemErrors:
    """The item errors sent and not yet retired. `send(reason, items)` queues one ITEM_ERRORS
    message for completion; `counts` is the stage's counter (dead_lettered, corrupt_input)."""

    def __init__(
        self,
        max_attempts: int,
        send: Callable[[str, np.ndarray], None],
        counts: collections.Counter,
        log: logging.Logger,
    ) -> None:
        self.max_attempts = max_attempts
        self.send = send
        self.counts = counts
        self.log = log
        self.unretired: list[list] = []  # [resend at, reason, items not yet seen retired]
        self.dead_letters: collections.deque[dict] = collections.deque(maxlen=RECENT_DEAD_LETTERS)

    def take(self, outcome: Outcome, now: float) -> None:
        """Send what left dispatch since the last step (DispatchState.take_outcomes)."""
        for items, reason in (
            (
                outcome.dead_letters,
                f"{ItemErrorCode.DEAD_LETTERED}: the item was reclaimed {self.max_attempts} time(s) (its worker "
                "died, stopped answering or let the lease expire each time)",
            ),
            (
                outcome.quarantined,
                f"{ItemErrorCode.CORRUPT_INPUT}: the stored item failed its checksum",
            ),
            (outcome.cancelled, f"{ItemErrorCode.CANCELLED}: the job was cancelled"),
        ):
            if len(items):
                self.send(reason, items)
                self.unretired.append([now + ITEM_ERRORS_RESEND_S, reason, items])
        for items, code in (
            (outcome.dead_letters, ItemErrorCode.DEAD_LETTERED),
            (outcome.quarantined, ItemErrorCode.CORRUPT_INPUT),
        ):
            if len(items):
                self.note(items, code)

    def note(self, items: np.ndarray, code: str) -> None:
        """Count dead-lettered or corrupt items and keep one event per job for BROKER_STATUS."""
        self.counts[code] += len(items)
        jobs = item_seq.job_of(items["seq"])
        for job_no in np.unique(jobs).tolist():
            mine = items[jobs == job_no]
            self.dead_letters.append(
                {
                    "ns": time.time_ns(),  # a timestamp for people, never compared
                    "reason": code,
                    "job_no": int(job_no),
                    "items": len(mine),
                    "segments": np.unique(mine["segment"]).tolist(),
                }
            )

    def retired(self, items: np.ndarray) -> None:
        """Completion retired these slots (RETIRED names slots, its seqs are 0): match by slot;
        segment ids are never reused."""
        retired = slot_key(items)
        for entry in self.unretired:
            entry[2] = entry[2][~np.isin(slot_key(entry[2]), retired)]
        self.unretired = [e for e in self.unretired if len(e[2])]

    def resend(self, now: float) -> None:
        """Item errors completion has not retired within ITEM_ERRORS_RESEND_S go again."""
        for entry in self.unretired:
            due, reason, items = entry
            if now >= due:
                self.log.warning(
                    "%d item error(s) not retired %g s after sending; sent again",
                    len(items),
                    ITEM_ERRORS_RESEND_S,
                )
                self.send(reason, items)
                entry[0] = now + ITEM_ERRORS_RESEND_S

    @property
    def unretired_items(self) -> int:
        """Item errors sent to completion and not yet named by its RETIRED."""
        return sum(len(entry[2]) for entry in self.unretired)
