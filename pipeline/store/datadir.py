"""The data directory: where each kind of file lives, and who may use it.

| path                         | what                                           |
|------------------------------|------------------------------------------------|
| `<data_dir>/broker.lock`     | flock held exclusively by the broker (or check --fix); holds its pid |
| `<data_dir>/segments/`       | the input log: `in-<id>.<model>.s<shape>.l<lane>.seg` (the model's name file-safe: pipeline/core/file_names.py) |
| `<data_dir>/damaged/`        | damaged input segments moved aside at start (pipeline/store/salvage.py); never read by a stage |
| `<data_dir>/losses-owed`     | written before a start moves a damaged segment aside, removed once the lost items have their error results (collector/losses.py); present at a start: account again |
| `<data_dir>/completion/`     | the completion log: `out-<id>.<job>.s0.l<size class>.seg` (collector/completion/results_log.py) |
| `<data_dir>/next-segment-id` | the lowest id not yet handed out (text)         |
| `<data_dir>/next-batch-id`   | dispatch's batch ids: the lowest not yet reserved (text, blocks of 2^20) |
| `<data_dir>/work-token.key`  | the secret of dispatch's work tokens (gpu/dispatch/work_token.py); 0600, never replaced |
| `<data_dir>/log/`            | one log file per stage process                  |
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from pipeline.core.errors import DataDirLockedError
from pipeline.store.segment_format import KIND_COMPLETION, KIND_INPUT, SUFFIX, TMP_SUFFIX

LOCK_NAME = "broker.lock"


class DataDir:
    """Paths under one data dir, and its exclusive lock."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.segments = self.root / "segments"
        self.completion = self.root / "completion"
        self.damaged = self.root / "damaged"
        self.losses_owed = self.root / "losses-owed"
        self.log = self.root / "log"
        self._lock_fd = -1

    def segment_dir(self, kind: int) -> Path:
        return {KIND_INPUT: self.segments, KIND_COMPLETION: self.completion}[kind]

    def ensure(self) -> DataDir:
        """Create the directories if missing; returns self."""
        for path in (self.segments, self.completion, self.log):
            path.mkdir(parents=True, exist_ok=True)
        return self

    def segment_files(self) -> list[Path]:
        """Every segment file of both logs, input log first, each sorted by id."""
        files: list[Path] = []
        for directory in (self.segments, self.completion):
            if directory.is_dir():
                files.extend(sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX)))
        return files

    def temp_files(self) -> list[Path]:
        """Leftovers of segment creation interrupted by a crash (never acknowledged)."""
        found: list[Path] = []
        for directory in (self.segments, self.completion):
            if directory.is_dir():
                found.extend(sorted(p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX)))
        return found

    def lock(self) -> None:
        """Take the data dir's exclusive lock or raise DataDirLockedError naming the holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLockedError(
                f"data dir {self.root} is in use by pid {holder} (a running broker or check); "
                f"stop it first or use another data_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
