"""What time takes back from workers: silent sessions, expired leases, stalled sessions.

| cause          | when                                                         | reclaimed                     | counted as `reclaimed` cause |
|----------------|--------------------------------------------------------------|-------------------------------|------------------------------|
| a silent session | no message for `dispatch.session_timeout_s`                | all it held; the session gone | `session_lost`               |
| an expired lease | past its deadline (`lease_s` from the last renewal)        | the lease's items             | `lease_expired`              |
| a stalled session | reports (renewing its leases) but no results past its stall limit (gpu/dispatch/stall.py) | its unanswered batches; no new work until its results come | `stalled` |

An attempt is counted for each batch the worker may have started. Nothing
expires before the state is `loaded()` (invariant 9). Silent sessions and
leases are looked at every step; stalls on the rescan, once a second. These
functions work on the stage, as gpu/dispatch/report.py reads it.
"""

from __future__ import annotations


def expire_sessions_and_leases(stage, now: float) -> None:
    """Drop sessions silent past their timeout and reclaim leases past their deadline."""
    limit = stage.config.session_timeout_s
    for session_id, session in list(stage.sessions.items()):
        if now - session.last_seen > limit:
            lost = stage.state.drop_session(session_id)
            stage.reclaimed["session_lost"] += lost
            del stage.sessions[session_id]
            stage.stall.forget(session_id)
            stage.log.warning(
                "session %s silent for %.1f s (limit %.1f s): gone; %d item(s) reclaimed",
                session_id,
                now - session.last_seen,
                limit,
                lost,
            )
    expired = stage.state.expire(now)
    stage.reclaimed["lease_expired"] += expired
    if expired:
        stage.log.warning("%d item(s) reclaimed after their lease expired", expired)


def reclaim_stalled(stage, now: float) -> None:
    """Sessions that report (renewing their leases) but send no results past their stall
    limit (gpu/dispatch/stall.py): their unanswered batches go back to the queue."""
    holding = {s: stage.state.session_batches(s) for s in stage.sessions}
    for stall in stage.stall.find(holding, now):
        back = stage.state.reclaim_unanswered(stall.session)
        stage.reclaimed["stalled"] += back
        stage.log.warning(
            "session %s holds batches with no results for %.1f s (stall limit %.1f s): "
            "stalled; %d item(s) reclaimed, no new work until its results come",
            stall.session,
            stall.silent_s,
            stall.limit_s,
            back,
        )
