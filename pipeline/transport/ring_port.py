"""A stage's end of a ring that follows the supervisor's replacements.

When a stage dies the supervisor unlinks its rings and creates new ones
under the same names (what was in them is dropped; the front times out the
chunks involved and producers retry them). A `RingPort` notices a
replacement by the ring's creation time and re-attaches, at most every
`check_s` and whenever the ring looks stuck (full for a producer, empty for
a consumer).

It re-attaches only a ring created by the process that created the one it had: the
supervisor of its own broker life. A ring created again by another process belongs to
a newer broker life on the same data dir, started while this stage of an ended life
still runs (it dies with its supervisor, but not at once): joining it would make two
consumers of one ring, each appending or routing every record, so `get` raises
RingError and the stage stops instead.
"""

from __future__ import annotations

import logging
import time

from pipeline.core.errors import RingError
from pipeline.transport.ring import Ring

log = logging.getLogger("fabric.ring")


class RingPort:
    """Attach lazily, re-attach after a replacement."""

    def __init__(self, name: str, check_s: float = 0.5) -> None:
        self.name = name
        self.check_s = check_s
        self.ring: Ring | None = None
        self._created_ns: int | None = None
        self._creator_pid: int | None = None  # the supervisor of this stage's broker life
        self._checked_s = 0.0

    def get(self, now_s: float | None = None) -> Ring | None:
        """The current ring, re-attached if it was replaced; None if it does not exist yet."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.ring is not None and now_s - self._checked_s < self.check_s:
            return self.ring
        self._checked_s = now_s
        created = Ring.created_ns_of(self.name)
        if created is None:
            return None
        if self.ring is None or created != self._created_ns:
            if self.ring is not None:
                log.warning(
                    "ring %s was replaced; re-attaching (its old content is dropped)", self.name
                )
                self.ring.close()
            try:
                ring = Ring.attach(self.name)
            except RingError as exc:
                log.warning("cannot attach ring %s yet: %s", self.name, exc)
                self.ring = None
                return None
            creator = ring.creator_pid
            if self._creator_pid is not None and creator != self._creator_pid:
                ring.close()
                self.ring = None
                raise RingError(
                    f"ring {self.name} was created again by process {creator}, not by this "
                    f"stage's supervisor (process {self._creator_pid}): a newer broker life "
                    "runs on this data dir and this stage belongs to an ended one; it stops"
                )
            self.ring, self._creator_pid, self._created_ns = ring, creator, created
        return self.ring

    def stale(self) -> None:
        """Force a re-check on the next `get()` (the ring looked stuck)."""
        self._checked_s = 0.0

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
