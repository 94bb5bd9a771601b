"""Cancel: a client's CANCEL recorded as `jobs/<id>/cancel` and passed on to dispatch.

A job already `completed`, `expired` or `failed` (a limit stopped it) is refused. Otherwise, unless it is
cancelled already, the cancel mark is written (collector/job_view.py
`write_cancel`: the job number and the wall-clock ns, atomically; and
`expired` for a CANCEL with `"reason": "expired"`, the HTTP API's batch
driver's at a batch's deadline: such a job ends `expired`), and
CANCEL_JOB goes to dispatch on every request (dispatch may have restarted; it
also reads the marks at start). Dispatch sends the job's queued items back
as `cancelled` error results; once every item is retired the job finishes
(collector/completion/finishing.py) as `cancelled`.
"""

from __future__ import annotations

import logging

import zmq

from collector.job_view import JobView, write_cancel
from pipeline.core.errors import FabricError
from pipeline.core.job_states import JobState
from pipeline.store.segment import disk_error
from pipeline.transport import wire

NOT_CANCELLABLE = (JobState.COMPLETED, JobState.EXPIRED, JobState.FAILED)
AT_DEADLINE = JobState.EXPIRED  # a CANCEL's `reason` when the job's deadline passed


def refusal(view: JobView, state: str, reason: object = None) -> str | None:
    """Why the job cannot be cancelled in `state` (for `reason`, the CANCEL's), or None."""
    if reason not in (None, AT_DEADLINE):
        return (
            f"cancel reason {reason!r} for job {view.job_id} is not known: send none, or "
            f"'{AT_DEADLINE}' for a job cancelled at its deadline"
        )
    if state in NOT_CANCELLABLE:
        return f"job {view.job_id} is already {state}"
    return None


def cancel_job(
    view: JobView, dispatch: zmq.Socket, log: logging.Logger, reason: str | None = None
) -> None:
    """Record the cancel (once; `reason` AT_DEADLINE: the job then ends `expired`) and tell
    dispatch. DiskFullError: the mark is not written (the client is told to ask again)."""
    if not view.cancelled:
        at_deadline = reason == AT_DEADLINE
        try:
            write_cancel(view, at_deadline)
        except OSError as exc:
            raise disk_error(exc, view.cancel_path, "recording a cancel") from exc
        why = "at its deadline" if at_deadline else "by a client"
        log.info("job %s cancelled %s", view.job_id, why)
    send_cancel(view, dispatch, log)  # again on every request: dispatch may have restarted


def send_cancel(view: JobView, dispatch: zmq.Socket, log: logging.Logger) -> None:
    """Tell dispatch the job is cancelled (it also reads the marks when it starts)."""
    try:
        wire.send(dispatch, wire.MessageType.CANCEL_JOB, {"job_no": view.job_no})
    except FabricError as exc:
        log.warning("could not tell dispatch of the cancel yet: %s", exc)
