"""What `status` says about stages that keep dying, from the supervisor's report.

A local worker that crash-loops (an engine that dies on some input) is never
given up on: the supervisor restarts it after a backoff that doubles with
each death in a row, and says so in its report (`<data_dir>/supervisor.json`,
pipeline/process/supervisor_report.py), so that `run.py status` (dispatch reads it
for its BROKER_INFO answer) shows why work is not moving instead of
"(no workers)". `read_restarts` lists the local workers that died in this
broker's life, with the report's per-stage fields (`stage`, `state`:
`running` or `restarting`, `deaths_in_a_row`, `deaths`, `last_exit`,
`last_error`, `restart_at_ns`) and `restart_in_s`.

It also finds, for the supervisor, the last error line a stage logged before
it died (`last_error_line`): shown to people, never parsed by programs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pipeline.process.supervisor_report import read_report

LOG_TAIL_BYTES = 16 * 1024
MAX_ERROR_CHARS = 300
FIELDS = ("stage", "deaths_in_a_row", "deaths", "last_exit", "last_error", "restart_at_ns")


def read_restarts(data_root: Path, now_ns: int | None = None) -> list[dict[str, Any]]:
    """The local workers that died in this broker's life, each with `restart_in_s` (seconds
    until its next start, 0 when running); [] when there is no report or nothing died."""
    report = read_report(data_root)
    if report is None or not report.get("running"):
        return []
    now_ns = time.time_ns() if now_ns is None else now_ns
    stages = []
    for entry in report["stages"]:
        if entry.get("critical", True) or not entry.get("deaths"):
            continue
        stage = {key: entry.get(key) for key in FIELDS}
        stage["state"] = "restarting" if entry["state"] == "restarting" else "running"
        at = int(entry.get("restart_at_ns") or 0)
        stage["restart_in_s"] = round(max(0.0, (at - now_ns) / 1e9), 1) if at else 0.0
        stages.append(stage)
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
