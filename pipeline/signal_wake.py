"""A pipe that signals write to, so that a loop waiting on file descriptors wakes at once.

The supervisor sleeps until a stage exits or something is due (pipeline/supervisor.py);
Python runs a signal handler only between bytecodes, and a wait that a signal interrupts
is resumed with what was left of its timeout. `signal.set_wakeup_fd` makes the C-level
handler write a byte to this pipe as well, so a wait that includes `SignalWake.fd` ends
when SIGTERM arrives instead of at its next timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal


class SignalWake:
    """The pipe, installed as the process's wakeup fd until `close()`. `fd` is None where
    wakeup fds cannot be set (not the main thread): a loop's timeouts still see its flags."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._write: int | None = None
        self._previous = -1
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(read)
            os.close(write)
            return
        self.fd, self._write = read, write

    def drain(self) -> None:
        """Read what signals wrote (the signal numbers; the handlers have the rest)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 512):
                pass

    def close(self) -> None:
        """Put back the wakeup fd there was before, and close the pipe."""
        if self.fd is None:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self.fd)
        os.close(self._write)
        self.fd = self._write = None
