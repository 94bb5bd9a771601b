"""When the supervisor restarts a stage that died, and when it gives up (pipeline/process/supervisor.py).

| how it died                             | restarted after                                   | gives up |
|-----------------------------------------|---------------------------------------------------|----------|
| a full disk (`DISK_FULL_EXIT`)          | `DISK_FULL_BACKOFF_S`: a restart frees nothing    | never    |
| a local worker (not critical)           | `restart_backoff_s`, doubling with each death in a row, at most `WORKER_MAX_BACKOFF_S` | never (invariant 14) |
| any other stage (critical)              | `restart_backoff_s`, doubling with each recent death, at most `MAX_BACKOFF_S` | more than `max_restarts` deaths within `restart_window_s`: the broker stops (exit 5) |

A local worker is never given up on: giving up would stop all work silently while dispatch
has not yet dead-lettered the poison item that kills it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from pipeline.process.stage_child import StageChild

log = logging.getLogger("fabric.supervisor")
MAX_BACKOFF_S = 30.0
WORKER_MAX_BACKOFF_S = 60.0  # a crash-looping local worker is restarted at least this often
DISK_FULL_BACKOFF_S = 5.0  # a stage that stopped on a full disk (DISK_FULL_EXIT) waits this much


class RestartConfig(Protocol):
    """`[supervisor]`'s restart keys (config/settings.py SupervisorSettings)."""

    @property
    def restart_backoff_s(self) -> float: ...
    @property
    def max_restarts(self) -> int: ...
    @property
    def restart_window_s(self) -> float: ...


def plan_restart(
    child: StageChild, now: float, how: str, disk_full: bool, config: RestartConfig, log_path: Path
) -> str | None:
    """After `child` died (`how`), set when it restarts (`child.restart_at`) and count the
    death; return the line that stops the broker when a critical stage crash-loops (its
    `restart_at` then stays None), else None."""
    if disk_full:  # a restart frees nothing: never a crash loop, and no hurry
        child.restart_at = now + DISK_FULL_BACKOFF_S
        log.error(
            "stage %s stopped on a full disk (see its log); restarting it in %.1f s",
            child.spec.label,
            DISK_FULL_BACKOFF_S,
        )
        return None
    if not child.spec.critical:
        _restart_worker(child, now, how, config)
        return None
    window = config.restart_window_s
    child.deaths.append(now)
    while child.deaths and child.deaths[0] < now - window:
        child.deaths.popleft()
    if len(child.deaths) > config.max_restarts:
        failure = (
            f"stage {child.spec.label} died {len(child.deaths)} times within {window:g} s "
            f"(last: {how}); see {log_path}"
        )
        log.error("%s", failure)
        return failure
    backoff = min(MAX_BACKOFF_S, config.restart_backoff_s * 2 ** (len(child.deaths) - 1))
    child.restart_at = now + backoff
    log.warning("stage %s died (%s); restarting it in %.1f s", child.spec.label, how, backoff)
    return None


def _restart_worker(child: StageChild, now: float, how: str, config: RestartConfig) -> None:
    """A local worker died: restart it after a backoff that doubles with each death in a
    row (capped at WORKER_MAX_BACKOFF_S), and never give up."""
    if now - child.started_at >= config.restart_window_s:
        child.in_a_row = 0  # it ran a good while: this death starts a new streak
    child.in_a_row += 1
    backoff = min(WORKER_MAX_BACKOFF_S, config.restart_backoff_s * 2 ** min(child.in_a_row - 1, 30))
    child.restart_at = now + backoff
    level = logging.ERROR if child.in_a_row > config.max_restarts else logging.WARNING
    log.log(
        level,
        "stage %s died (%s; %d deaths in a row); restarting it in %.1f s%s",
        child.spec.label,
        how,
        child.in_a_row,
        backoff,
        f"; its log said: {child.last_error}" if child.last_error else "",
    )
