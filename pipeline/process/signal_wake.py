"""A pipe that signals write to, so that a loop waiting on file descriptors wakes at once.

The supervisor sleeps until a stage exits or something is due (pipeline/process/supervisor.py);
Python runs a signal handler only between bytecodes, and a wait that a signal interrupts
is resumed with what was left of its timeout. `signal.set_wakeup_fd` makes the C-level
handler write a byte to this pipe as well, so a wait that includes `SignalWake.fd` ends
when SIGTERM arrives instead of at its next timeout.
"""

from __future__ import annotations

import signal

from pipeline.core.wake_pipe import WakePipe


class SignalWake:
    """A wake pipe (pipeline/core/wake_pipe.py), installed as the process's wakeup fd until
    `close()`. `fd` is None where wakeup fds cannot be set (not the main thread): a loop's
    timeouts still see its flags."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._pipe: WakePipe | None = None
        self._previous = -1
        pipe = WakePipe()
        try:
            self._previous = signal.set_wakeup_fd(pipe.write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            pipe.close()
            return
        self._pipe, self.fd = pipe, pipe.fd

    def drain(self) -> None:
        """Read what signals wrote (the signal numbers; the handlers have the rest)."""
        if self._pipe is not None:
            self._pipe.drain()

    def close(self) -> None:
        """Put back the wakeup fd there was before, and close the pipe."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous)
        self._pipe.close()
        self._pipe = self.fd = None
