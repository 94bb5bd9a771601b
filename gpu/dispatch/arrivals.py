"""When the slots of each input segment became durable, to within `resolution_s`: queue age.

Dispatch learns of new slots as (segment, written end) notices. `Arrivals`
keeps, per segment, a short list of marks (end, wall time): every slot
below `end` and not below the previous mark's end was durable by `time`. A
notice within `resolution_s` of the last mark extends that mark instead of
adding one, so a segment gains at most one mark per `resolution_s` and an
age is overstated by at most that much. Slots found on disk at start count
from their segment's creation (an upper bound: nothing older is known).

`arrived(segment, slot)` answers "since when has this slot been waiting";
`forget_below` drops marks no slot can need any more (everything below the
segment's cursor and its earliest leased slot is out or retired).
"""

from __future__ import annotations

import bisect


class Arrivals:
    """Per-segment arrival marks; single-owner, like the rest of dispatch's state."""

    def __init__(self, resolution_s: float = 1.0) -> None:
        self.resolution_s = resolution_s
        self._ends: dict[int, list[int]] = {}
        self._times: dict[int, list[float]] = {}

    def seen(self, segment_id: int, end: int, wall_s: float) -> None:
        """Slots of `segment_id` below `end` are durable at `wall_s` (seconds since the epoch)."""
        ends = self._ends.setdefault(segment_id, [])
        times = self._times.setdefault(segment_id, [])
        if ends and end <= ends[-1]:
            return
        if ends and wall_s - times[-1] < self.resolution_s:
            ends[-1] = end
            return
        ends.append(end)
        times.append(wall_s)

    def arrived(self, segment_id: int, slot: int) -> float | None:
        """When `slot` became durable (wall seconds), or None if no notice covers it."""
        ends = self._ends.get(segment_id)
        if not ends:
            return None
        i = bisect.bisect_right(ends, slot)
        return self._times[segment_id][i] if i < len(ends) else None

    def forget_below(self, segment_id: int, slot: int) -> None:
        """Drop the marks that only cover slots below `slot`."""
        ends = self._ends.get(segment_id)
        if not ends:
            return
        cut = bisect.bisect_right(ends, slot)
        if cut:
            del ends[:cut]
            del self._times[segment_id][:cut]

    def forget(self, segment_id: int) -> None:
        self._ends.pop(segment_id, None)
        self._times.pop(segment_id, None)

    def marks(self, segment_id: int) -> int:
        return len(self._ends.get(segment_id, ()))
