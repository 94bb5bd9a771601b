"""A pipe that wakes a wait on file descriptors: its `fd` turns readable at `wake()`.

The supervisor's threads (the heartbeat port, the metrics intake and the metrics
HTTP server: pipeline/process/heartbeat.py, pipeline/telemetry/metrics_server.py) wait on their
socket and this fd with no timeout, so an idle broker's supervisor does not wake
dozens of times a second only to look at a stop flag, and a stop is seen at once.
pipeline/process/signal_wake.py installs one as the process's signal wakeup fd.
"""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    """`fd` is readable once `wake()` was called, until `drain()` (both ends non-blocking)."""

    def __init__(self) -> None:
        self.fd, self.write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already readable), or closed
            os.write(self.write_fd, b"\0")

    def drain(self) -> None:
        """Read what was written: `fd` is not readable again until the next wake."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 512):
                pass

    def close(self) -> None:
        for fd in (self.fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
