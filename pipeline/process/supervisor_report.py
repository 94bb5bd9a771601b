"""The supervisor's own report of its stages: `<data_dir>/supervisor.json`.

Logs are for people; programs read this. The supervisor replaces the file
whole (a reader sees the old file or the new one, never a part) whenever a
stage starts, comes up, dies or stops, and at start before recovery. Its
readers: `run.py status --watch` (recent restarts), dispatch's BROKER_INFO
(local workers that keep dying, through `pipeline/process/stage_restarts.py`), and
the test harness (stage pids, "every stage is up"). It describes the broker
life that wrote it: a reader tells a killed broker's stale report by `pid`.
It is a report, not a record: it is not fsynced, and a full disk leaves the
last one in place (the supervisor's log says so).

| field     | meaning                                                                 |
|-----------|-------------------------------------------------------------------------|
| `pid`     | the supervisor's process id                                             |
| `epoch`   | the broker life's epoch (ns since 1970), as the heartbeat port answers; 0 before it is set |
| `running` | false once the supervisor stopped every stage (a clean stop or a crash loop) |
| `ready`   | every stage was up at once ("ready" was said); stays true after          |
| `stages`  | one entry per stage, in start order (below)                              |
| `deaths`  | the latest deaths of this life, oldest first, at most `MAX_DEATHS`: `at_ns` (wall clock), `stage`, `how` (`signal SIGKILL`, `exit code 1`), `restart_in_s` (its backoff; null when the broker gives up on it) |

| field (per stage) | meaning                                                          |
|-------------------|------------------------------------------------------------------|
| `stage`           | the stage label, e.g. `worker-0`                                 |
| `pid`             | its running process, or 0 when none runs                         |
| `state`           | `starting` (spawned, not yet up), `up` (opened its sockets), `restarting` (dead, waiting out its backoff), `stopped` |
| `critical`        | a crash loop of it stops the broker (false for local workers: restarted forever) |
| `restarts`        | processes started under this label after its first, in this life |
| `deaths`          | deaths in this life                                              |
| `deaths_in_a_row` | for a local worker: deaths since it last ran `restart_window_s` without dying |
| `last_exit`       | how its last process ended (`signal SIGKILL`; `exit code 0` once stopped cleanly), or "" while its first runs |
| `last_error`      | the last ERROR line (or exception) it logged in its last life, or null |
| `restart_at_ns`   | wall clock (ns) of its next start while `restarting`, else 0     |
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import orjson

REPORT_FILE = "supervisor.json"
MAX_DEATHS = 32  # deaths kept in the report: enough for a dashboard's "recent restarts"
STATES = ("starting", "up", "restarting", "stopped")


def write_report(data_root: Path, report: dict[str, Any]) -> None:
    """Replace the report with `report` (the fields of the tables above). Raises OSError."""
    path = Path(data_root) / REPORT_FILE
    tmp = path.with_name(f".{REPORT_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(orjson.dumps(report))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_report(data_root: Path) -> dict[str, Any] | None:
    """The report, or None when there is none or it cannot be read (no broker ran here)."""
    try:
        report = orjson.loads((Path(data_root) / REPORT_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and isinstance(report.get("stages"), list) else None


def stage_pids(report: dict[str, Any] | None) -> dict[str, int]:
    """Stage label -> pid of its running process (stages with none left out)."""
    if report is None:
        return {}
    return {s["stage"]: s["pid"] for s in report["stages"] if s.get("pid")}


def all_up(report: dict[str, Any] | None, supervisor_pid: int | None = None) -> bool:
    """Every stage of the broker life is up (and, given `supervisor_pid`, that life is the
    one of that supervisor process): a client finds every port listening."""
    if report is None or not report.get("running") or not report.get("ready"):
        return False
    if supervisor_pid is not None and report.get("pid") != supervisor_pid:
        return False
    return all(s["state"] == "up" for s in report["stages"])


def left_from_last_life(data_root: Path) -> list[int]:
    """Pids of the stages the last report names that still run and were started before it was
    last written: a broker life killed a moment ago, whose stages are still exiting (they die
    with their fork server, which dies with its supervisor). A pid taken since by another
    process started later, so it is left out."""
    path = Path(data_root) / REPORT_FILE
    report = read_report(data_root)
    if report is None:
        return []
    try:
        written = path.stat().st_mtime
        stat_lines = Path("/proc/stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in stat_lines if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return []
    tick = os.sysconf("SC_CLK_TCK")
    left = []
    for pid in stage_pids(report).values():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone
        fields = stat[stat.rindex(")") + 2 :].split()
        if not still_running(pid, fields[0]):
            continue  # exited; only its parent's wait is left
        if boot + int(fields[19]) / tick <= written + 1.0:
            left.append(pid)
    return left


def still_running(pid: int, state: str | None = None) -> bool:
    """Whether process `pid` still holds what it had open (ports included): it exists and is
    not a zombie, or is a zombie whose other threads are still exiting. `state`: its state
    letter from /proc/PID/stat, when the caller has read it already."""
    if state is None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        state = stat[stat.rindex(")") + 2]
    return state != "Z" or _threads_exiting(pid)


def _threads_exiting(pid: int) -> bool:
    """`pid` is a zombie whose other threads are still exiting. A process killed by a
    signal shows its main thread as a zombie at once, while its other threads (ZeroMQ's I/O
    thread, which owns the stage's listening sockets) may take a moment more, and the open
    files, ports included, are released with the last of them."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # gone
        if stat[stat.rindex(")") + 2] not in "ZX":
            return True
    return False
