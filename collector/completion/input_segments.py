"""The input segments completion has open to write tombstones into, by segment id.

Opened writable on first use (`get`); one whose every slot is retired and that is sealed is
closed again at the next tidy (`release_finished`), so the segment collector may remove it.
"""

from __future__ import annotations

from pipeline.core.errors import SegmentError
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment


class InputSegments:
    def __init__(self, data_dir: DataDir) -> None:
        self.data_dir = data_dir
        self.open: dict[int, Segment] = {}

    def get(self, segment_id: int) -> Segment:
        """Input segment `segment_id`, writable; SegmentError if it does not exist."""
        segment = self.open.get(segment_id)
        if segment is None:
            paths = list(self.data_dir.segments.glob(f"in-{segment_id:012d}.*.seg"))
            if not paths:
                raise SegmentError(f"input segment {segment_id} does not exist (collected?)")
            segment = Segment.open(paths[0], writable=True)
            self.open[segment_id] = segment
        return segment

    def release_finished(self) -> None:
        """Close the sealed segments whose every slot is retired."""
        for segment_id, segment in list(self.open.items()):
            if segment.sealed and segment.deleted >= segment.entries:
                segment.close()
                del self.open[segment_id]

    def close(self) -> None:
        for segment in self.open.values():
            segment.close()
        self.open.clear()
