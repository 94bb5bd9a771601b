"""A pipe that wakes a thread blocked on file descriptors: its `fd` turns readable at `wake()`.

The supervisor's threads (the heartbeat port, the metrics intake and the metrics
HTTP server: pipeline/heartbeat.py, pipeline/metrics_server.py) wait on their
socket and this fd with no timeout, so an idle broker's supervisor does not wake
dozens of times a second only to look at a stop flag, and a stop is seen at once.
"""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    """`fd` is readable once `wake()` was called (and stays so: it is never drained)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # already readable, or closed
            os.write(self._write, b"\0")

    def close(self) -> None:
        for fd in (self.fd, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
