"""What the supervisor tells `status` about stages that keep dying: `<data_dir>/restarts.json`.

A local worker that crash-loops (an engine that dies on some input) is never
given up on: the supervisor restarts it after a backoff that doubles with
each death in a row, and says so here, so that `run.py status` (dispatch
reads this file for its BROKER_INFO answer) shows why work is not moving
instead of "(no workers)". The supervisor rewrites the file (atomically)
whenever a stage dies or starts; it lists only stages that died in this
broker's life.

| field (per stage)  | meaning                                                           |
|--------------------|-------------------------------------------------------------------|
| `stage`            | the stage label, e.g. `worker-0`                                  |
| `state`            | `running`, or `restarting` (dead, waiting out its backoff)        |
| `deaths_in_a_row`  | deaths since it last ran `restart_window_s` without dying         |
| `deaths`           | deaths in this broker's life                                      |
| `last_exit`        | how it last ended: `signal SIGKILL`, `exit code 1`                |
| `last_error`       | the last ERROR line (or exception) it logged in its last life, or null |
| `restart_at_ns`    | wall clock (ns) of the next start while `restarting`, else 0      |
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from pipeline.durable import write_whole

RESTARTS_FILE = "restarts.json"
LOG_TAIL_BYTES = 16 * 1024
MAX_ERROR_CHARS = 300


def write_restarts(data_root: Path, stages: list[dict[str, Any]]) -> None:
    """Replace the file with `stages` (the fields of the table above)."""
    write_whole(Path(data_root) / RESTARTS_FILE, orjson.dumps({"stages": stages}))


def read_restarts(data_root: Path, now_ns: int | None = None) -> list[dict[str, Any]]:
    """The stages in the file, each with `restart_in_s` (seconds until its next start, 0 when
    running); [] when there is no file or it cannot be read (nothing died yet)."""
    try:
        stages = orjson.loads((Path(data_root) / RESTARTS_FILE).read_bytes())["stages"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    now_ns = time.time_ns() if now_ns is None else now_ns
    for stage in stages:
        at = int(stage.get("restart_at_ns") or 0)
        stage["restart_in_s"] = round(max(0.0, (at - now_ns) / 1e9), 1) if at else 0.0
    return stages


def describe(stage: dict[str, Any]) -> str:
    """One line for people: 'restarting in 4s after 3 deaths: signal SIGKILL (...)'."""
    why = stage["last_exit"]
    if stage.get("last_error"):
        why += f"; its log said: {stage['last_error']}"
    if stage["state"] == "restarting":
        return (
            f"restarting in {stage['restart_in_s']:.0f}s after {stage['deaths_in_a_row']} "
            f"deaths in a row: {why}"
        )
    return f"running; died {stage['deaths']} times in this broker's life (last: {why})"


def log_size(log_path: Path) -> int:
    """Where a stage's log ends now (0 if it has none): pass it to `last_error_line` later."""
    try:
        return os.path.getsize(log_path)
    except OSError:
        return 0


def last_error_line(log_path: Path, since: int = 0) -> str | None:
    """The last ERROR line (or the last line of a traceback) a stage logged after byte `since`
    of its log (where it ended when the stage started), within the last LOG_TAIL_BYTES."""
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < since:  # rotated meanwhile: all of the new file is this life's
                since = 0
            f.seek(max(since, size - LOG_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for i in range(len(tail) - 1, -1, -1):
        line = tail[i]
        if " ERROR " in line or " CRITICAL " in line:
            # an exception's own line ends the traceback that follows the ERROR line
            after = [t for t in tail[i + 1 :] if t and not t.startswith((" ", "Traceback"))]
            text = after[-1] if after else line
            return text[:MAX_ERROR_CHARS]
    return None
