"""Pause, resume and priority: a client's CONTROL recorded as marks and passed on to dispatch.

A CONTROL names the job and `paused` (true: pause, false: resume) and/or
`priority` (an integer, higher first). A job that has ended (`completed`,
`cancelled`, `expired`) or is being cancelled is refused. The marks
(pipeline/store/job_files.py): `jobs/<id>/pause` while the job is paused,
`jobs/<id>/priority` with its latest priority; both are written before
dispatch is told, so a restarted dispatch reads what the client was told.
JOB_CONTROL goes to dispatch on every request (dispatch may have restarted;
it also reads the marks at start). Items in flight finish; a paused job's
queued items wait, and its deadline keeps running.
"""

from __future__ import annotations

import logging
import time

import zmq

from collector.job_view import JobView
from pipeline.core.errors import FabricError
from pipeline.core.job_states import JobState
from pipeline.store.job_record import PRIORITY_LIMIT
from pipeline.store.segment import disk_error
from pipeline.transport import wire

ENDED = (JobState.COMPLETED, JobState.CANCELLED, JobState.EXPIRED, JobState.CANCELLING)


def refusal(view: JobView, state: str, meta: dict) -> str | None:
    """Why the CONTROL `meta` cannot apply to the job in `state`, or None."""
    paused, priority = meta.get("paused"), meta.get("priority")
    if paused is None and priority is None:
        return f"control of job {view.job_id} names nothing to change: send paused or priority"
    if paused is not None and not isinstance(paused, bool):
        return f"paused {paused!r} for job {view.job_id} is not true or false"
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or abs(priority) > PRIORITY_LIMIT
    ):
        return (
            f"priority {priority!r} for job {view.job_id} is not an integer from "
            f"-{PRIORITY_LIMIT} to {PRIORITY_LIMIT}"
        )
    if state in ENDED:
        return f"job {view.job_id} is already {state}: there is nothing left to control"
    if view.cancelled:
        return f"job {view.job_id} is already cancelled: its queued items are being retired"
    return None


def control_job(view: JobView, meta: dict, dispatch: zmq.Socket, log: logging.Logger) -> None:
    """Record the change (marks first) and tell dispatch. DiskFullError: not recorded (the
    client is told to ask again)."""
    files, job_id = view.files, view.job_id
    paused, priority = meta.get("paused"), meta.get("priority")
    try:
        if paused is True and not files.is_paused(job_id):
            files.mark_paused(job_id, view.job_no, time.time_ns())
            log.info("job %s paused by a client", job_id)
        elif paused is False and files.is_paused(job_id):
            files.clear_paused(job_id)
            log.info("job %s resumed by a client", job_id)
        if priority is not None and priority != view.current_priority:
            files.mark_priority(job_id, view.job_no, int(priority))
            log.info("job %s: priority %d", job_id, priority)
    except OSError as exc:
        raise disk_error(exc, files.directory(job_id), "recording a pause or priority") from exc
    news = {"job_no": view.job_no, "job": job_id, "paused": files.is_paused(job_id)}
    try:  # again on every request: dispatch may have restarted (it also reads the marks)
        wire.send(
            dispatch, wire.MessageType.JOB_CONTROL, {**news, "priority": view.current_priority}
        )
    except FabricError as exc:
        log.warning("could not tell dispatch of the change yet: %s", exc)
