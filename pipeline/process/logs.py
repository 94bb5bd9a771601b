"""Per-stage log files: `<data_dir>/log/<stage>-<n>.log`, one line per event.

Line format: `2026-11-30T05:12:03.123Z INFO router-0 4242 message`, timestamp
first (UTC, ISO 8601), so `tail -F` and `sort -m` across stages work. The
file is reopened when logrotate moves it (WatchedFileHandler).
"""

from __future__ import annotations

import logging
import logging.handlers
import time
from pathlib import Path

FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(stage)s %(process)d %(message)s"
DATEFMT = "%Y-%m-%dT%H:%M:%S"


class _StageFilter(logging.Filter):
    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def filter(self, record: logging.LogRecord) -> bool:
        record.stage = self.stage
        return True


def setup_stage_logging(
    log_dir: Path, stage: str, level: int = logging.INFO, echo: bool = False
) -> Path:
    """Send every `fabric.*` logger of this process to the stage's own file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{stage}.log"
    formatter = logging.Formatter(FORMAT, DATEFMT)
    formatter.converter = time.gmtime
    handlers: list[logging.Handler] = [logging.handlers.WatchedFileHandler(path)]
    if echo:
        handlers.append(logging.StreamHandler())
    root = logging.getLogger("fabric")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(_StageFilter(stage))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return path
