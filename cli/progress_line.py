"""The one progress line of every command that shows one (`submit`, `results`, `batch`,
`vectors export`, the demo), on stderr, so that stdout holds only answers.

On a terminal the line is redrawn in place (at most every `TTY_EVERY_S`, cut to the width
of the terminal: a line that wraps cannot be redrawn); elsewhere (a log, CI, a pipe) it is
printed as a line of its own every `every_s`, and a line that says the same as the last one
waits up to `QUIET_EVERY_S`, so a log gets a line per change, not per redraw.
What a job's line says (done/total, failed, rate, time left) is collector/status_view.py's
`job_fields`, as `status --watch` shows it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

TTY_EVERY_S = 0.1
QUIET_EVERY_S = 30.0
BAR_CELLS = 30


class ProgressLine:
    """One line of progress on `stream` (stderr); `show` it as often as you like."""

    def __init__(self, every_s: float = 2.0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self.last = float("-inf")
        self.said = ""
        self.drawn = False  # an in-place line is on the screen: what comes next needs a newline

    def show(self, text: str, final: bool = False) -> None:
        """Draw `text` if it is time to (`final`: now, and end the line on a terminal)."""
        now = time.monotonic()
        since = now - self.last
        if self.tty:
            due = since >= TTY_EVERY_S and text != self.said
        else:
            due = since >= (self.every_s if text != self.said else QUIET_EVERY_S)
        if not (due or final):
            return
        self.last, self.said = now, text
        if self.tty:  # back to the start, clear what was there
            self.stream.write("\r\x1b[K" + text[: self._columns() - 1])
            self.drawn = True
            if final:
                self.close()
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):  # not a real terminal's file after all
            return 80

    def say(self, line: str) -> None:
        """A line of news, on a line of its own (below the progress line on a terminal)."""
        self.close()
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the line redrawn in place, so that what is printed next starts a line."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(done: int, total: int | None, cells: int = BAR_CELLS) -> str:
    """`[##########....................]`; all dots while the total is not known yet."""
    filled = int(cells * min(done, total) / total) if total else 0
    return f"[{'#' * filled}{'.' * (cells - filled)}]"
