"""Cancel: a client's CANCEL recorded as `jobs/<id>/cancel` and passed on to dispatch.

A job already `completed` or `expired` is refused. Otherwise, unless it is
cancelled already, the cancel mark is written (collector/job_view.py
`write_cancel`: the job number and the wall-clock ns, atomically), and
CANCEL_JOB goes to dispatch on every request (dispatch may have restarted; it
also reads the marks at start). Dispatch sends the job's queued items back
as `cancelled` error results; once every item is retired the job finishes
(collector/completion/finishing.py) as `cancelled`.
"""

from __future__ import annotations

import logging

import zmq

from collector.job_view import JobView, write_cancel
from pipeline import wire
from pipeline.errors import FabricError
from pipeline.job_states import JobState
from pipeline.segment import disk_error

NOT_CANCELLABLE = (JobState.COMPLETED, JobState.EXPIRED)


def refusal(view: JobView, state: str) -> str | None:
    """Why the job cannot be cancelled in `state`, or None."""
    if state in NOT_CANCELLABLE:
        return f"job {view.job_id} is already {state}"
    return None


def cancel_job(view: JobView, dispatch: zmq.Socket, log: logging.Logger) -> None:
    """Record the cancel (once) and tell dispatch. DiskFullError: the mark is not written
    (the client is told to ask again)."""
    if not view.cancelled:
        try:
            write_cancel(view)
        except OSError as exc:
            raise disk_error(exc, view.cancel_path, "recording a cancel") from exc
        log.info("job %s cancelled by a client", view.job_id)
    try:  # again on every request: dispatch may have restarted (it also reads the mark)
        wire.send(dispatch, wire.MessageType.CANCEL_JOB, {"job_no": view.job_no})
    except FabricError as exc:
        log.warning("could not tell dispatch of the cancel yet: %s", exc)
