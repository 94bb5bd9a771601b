"""What writers and the completion stage tell dispatch, on its PULL inbox (`dispatch` ipc).

| message    | from       | what dispatch does                                                   |
|------------|------------|----------------------------------------------------------------------|
| APPENDED   | a writer   | slots up to `end` of a segment are durable: queued (gpu/dispatch/work_finder.py) |
| RETIRED    | completion | `items` retired for good: out of the queue and of their leases; `refused` results reclaimed with an attempt; then RESULTS_ACK to each worker in `acks` |
| CANCEL_JOB | completion | the job's queued items are taken out (they come back as `cancelled` errors) |
| JOB_CONTROL | completion | `paused`: the job's queued items are held back, or given back (gpu/dispatch/paused.py); `priority`: its new priority (gpu/dispatch/deadlines.py) |

A cancel outlives a restart as a mark in the job's directory (written by
completion, pipeline/store/job_files.py): `cancelled_jobs` reads the marks at
`open()`; so do a pause (gpu/dispatch/paused.py `paused_marks`) and a priority
(read with the job's record). These functions work on the stage, as gpu/dispatch/report.py reads it.
"""

from __future__ import annotations

import numpy as np

from pipeline.store.job_files import JobFiles
from pipeline.transport import wire

MT = wire.MessageType


def cancelled_jobs(data_root, log) -> set[int]:
    """Job numbers with a cancel mark (written by completion) and no `finished` mark: their
    queued items are taken out of dispatch (pipeline/store/job_files.py knows the marks)."""
    found = set()
    for mark, job_no in JobFiles(data_root).cancelled_running():
        if job_no is None:
            log.warning("unreadable cancel mark %s; ignored", mark)
        else:
            found.add(job_no)
    return found


def read_inbox(stage, now: float, max_messages: int) -> None:
    """Act on what arrived on the inbox, `max_messages` at most."""
    for message in stage.inbox.read(max_messages):
        meta = message.meta
        if message.type == MT.APPENDED:
            stage.finder.appended(int(meta["segment"]), int(meta["end"]), now)
        elif message.type == MT.RETIRED:
            retired(stage, message)
        elif message.type == MT.CANCEL_JOB:
            taken = stage.state.cancel_job(int(meta["job_no"]))
            stage.log.info("job %d cancelled: %d queued item(s) taken", meta["job_no"], taken)
        elif message.type == MT.JOB_CONTROL:
            job_no = int(meta["job_no"])
            stage.deadlines.set_priority(job_no, int(meta["priority"]), meta.get("job"))
            if meta["paused"]:
                held = stage.state.pause_job(job_no)
                stage.log.info("job %d paused: %d queued item(s) held", job_no, held)
            elif job_no in stage.state.paused.jobs:
                back = stage.state.resume_job(job_no)
                stage.log.info("job %d resumed: %d item(s) queued again", job_no, back)
        else:
            stage.log.error("unexpected internal message %s dropped", message.type.name)


def retired(stage, message: wire.Message) -> None:
    """RETIRED: items out for good, refused results reclaimed, then the workers' acks."""
    items = message.arrays.get("items")
    if items is not None and len(items):
        for segment_id in np.unique(items["segment"]).tolist():
            slots = items["slot"][items["segment"] == segment_id].astype(np.int64)
            stage.state.retired(int(segment_id), slots)
        stage.counts["retired"] += len(items)
        stage.item_errors.retired(items)
    refused, at = message.arrays.get("refused"), 0
    for session, batch_id, count in message.meta.get("refused", ()) if refused is not None else ():
        results_refused(stage, str(session), int(batch_id), refused[at : at + count])
        at += count
    for route_hex, result_id, count in message.meta["acks"]:
        route = bytes.fromhex(route_hex)
        session = stage.sessions.get(route.decode("ascii", "replace"))
        if session is not None:
            session.retired += int(count)
        stage.send(route, MT.RESULTS_ACK, {"result_ids": [result_id]})


def results_refused(stage, session: str, batch_id: int, items: np.ndarray) -> None:
    """Completion refused these results of the session's batch (collector/result_check.py):
    reclaim them counting an attempt, before the worker's ack goes out."""
    batch = stage.state.lease(batch_id)
    if batch is None or batch.session != session:
        return  # reclaimed meanwhile (a lease expiry, a lost session): counted then
    slots = items["slot"][items["segment"] == batch.segment_id].astype(np.int64)
    back = stage.state.reclaim(batch_id, count_attempt=True, slots=slots)
    stage.reclaimed["result_refused"] += back
    stage.log.info("session %s: %d item(s) reclaimed, their results refused", session, back)
