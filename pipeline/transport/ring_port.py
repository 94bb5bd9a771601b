"""A stage's end of a ring that follows the supervisor's replacements.

When a stage dies the supervisor unlinks its rings and creates new ones
under the same names (what was in them is dropped; the front times out the
chunks involved and producers retry them). A `RingPort` notices a
replacement by the ring's creation time and re-attaches, at most every
`check_s` and whenever the ring looks stuck (full for a producer, empty for
a consumer).
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
                self.ring = Ring.attach(self.name)
            except RingError as exc:
                log.warning("cannot attach ring %s yet: %s", self.name, exc)
                self.ring = None
                return None
            self._created_ns = created
        return self.ring

    def stale(self) -> None:
        """Force a re-check on the next `get()` (the ring looked stuck)."""
        self._checked_s = 0.0

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
