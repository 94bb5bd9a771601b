"""A job's states: the one list of what `status`, the results clients and the sinks may see.

| state         | produced by                                               | terminal |
|---------------|-----------------------------------------------------------|----------|
| `validating`  | the front, while a job's chunks are still arriving         | no       |
| `queued`      | completion, once every chunk is committed and no result yet | no       |
| `in_progress` | completion (some results) or dispatch (items with workers)  | no       |
| `cancelling`  | completion: cancelled, items still being retired           | no       |
| `completed`   | completion: every item has a result or an error            | yes      |
| `cancelled`   | completion: cancelled and every item retired               | yes      |
| `failed`      | completion: stopped by one of its limits (pipeline/core/job_limits.py) and every item retired | yes |
| `expired`     | completion: cancelled at its deadline and every item retired; or finished, then removed after its retention | yes      |

A terminal state never changes again. Values are the strings the wire and
`job.json` carry, so a `JobState` compares equal to its string.

Every door names a job's state with these words: `run.py status JOB`,
`status --watch`, `results` and `batch` show the state itself, and the HTTP
API shows a batch whose job has one the OpenAI Batch status `OPENAI_STATUS`
gives it (`BatchStatus`: OpenAI's statuses, one enum). The words are OpenAI's where OpenAI has the state; `queued` (no
item done or with a worker yet) is the broker's own, and OpenAI's
`in_progress`. OpenAI's `failed` is a job's `failed` (stopped by a limit), or the
HTTP API's own step when the input file did not validate; `finalizing` (the
output files being written) is the HTTP API's own step (api/batch_driver.py).

Paused is not a state: a job a client paused (`run.py pause`, the HTTP API's
`/pause`) keeps its state (`queued` or `in_progress`, and so OpenAI's
`in_progress`), and JOB_INFO carries `"paused": true` beside it
(collector/completion/control.py); `status` shows it, the HTTP API's batch
says it in its metadata (`fabric_paused`). A paused job still ends as any job
does: cancelled, or expired at its deadline.

`job_state` is the one place a job's state is worked out from its facts; the front
(its journal's `validating` -> `queued`), completion (JOB_INFO) and `status` (adding
dispatch's items in flight) all call it:

| facts                                                              | state         |
|--------------------------------------------------------------------|---------------|
| `total` unknown: not every chunk up to the final one is committed   | `validating`  |
| finished, fewer done than `total`, nothing undelivered (its delivered results were past retention and removed) | `expired` |
| every line done, cancelled at its deadline                         | `expired`     |
| every line done, stopped by a limit                                | `failed`      |
| every line done, cancelled by a client                             | `cancelled`   |
| every line done, not cancelled                                     | `completed`   |
| not every line done, cancelled by a client                         | `cancelling`  |
| some lines done, or items with workers (a cancel at the deadline or by a limit changes nothing yet) | `in_progress` |
| nothing done, nothing with a worker                                | `queued`      |
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    VALIDATING = "validating"
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.COMPLETED, JobState.CANCELLED, JobState.EXPIRED, JobState.FAILED})


class BatchStatus(StrEnum):
    """OpenAI's Batch statuses, the one list the HTTP API uses (api/batch_driver.py moves a
    batch through them). `failed` and `finalizing` are the API's own steps around a job."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """An ended batch: it never changes again, and cannot be cancelled."""
        return self in BATCH_TERMINAL


BATCH_TERMINAL = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)

# The OpenAI Batch status of a batch whose job is in each state.
OPENAI_STATUS: dict[JobState, BatchStatus] = {
    JobState.VALIDATING: BatchStatus.VALIDATING,
    JobState.QUEUED: BatchStatus.IN_PROGRESS,
    JobState.IN_PROGRESS: BatchStatus.IN_PROGRESS,
    JobState.CANCELLING: BatchStatus.CANCELLING,
    JobState.COMPLETED: BatchStatus.COMPLETED,
    JobState.CANCELLED: BatchStatus.CANCELLED,
    JobState.EXPIRED: BatchStatus.EXPIRED,
    JobState.FAILED: BatchStatus.FAILED,
}


def job_state(
    total: int | None,
    done: int = 0,
    *,
    cancelled: bool = False,
    at_deadline: bool = False,
    stopped: bool = False,
    finished: bool = False,
    undelivered: int = 0,
    in_flight: int = 0,
) -> JobState:
    """A job's state from its facts (the module table): `total` its lines once every chunk up
    to the final one is committed (None before), `done` its lines with a result or an error
    result, `cancelled` its cancel mark exists, `at_deadline` that mark says its deadline
    passed, `stopped` that mark says a limit stopped it, `finished` its finished mark exists, `undelivered` its results not delivered yet,
    `in_flight` its items with workers now (dispatch's count)."""
    if total is None:
        return JobState.VALIDATING
    if finished and done < total and not undelivered:
        return JobState.EXPIRED  # its delivered results are past retention, removed
    deadline = cancelled and at_deadline
    stopped = cancelled and stopped
    if done >= total:
        if deadline:
            return JobState.EXPIRED
        if stopped:
            return JobState.FAILED
        return JobState.CANCELLED if cancelled else JobState.COMPLETED
    if cancelled and not deadline and not stopped:
        return JobState.CANCELLING
    return JobState.IN_PROGRESS if done or in_flight else JobState.QUEUED


def openai_status(state: str) -> BatchStatus:
    """The OpenAI Batch status of a job state (a JobState or its string)."""
    return OPENAI_STATUS[JobState(state)]


def is_terminal(state: str | None) -> bool:
    """True for a terminal state's string (or JobState); False for anything else."""
    return state in TERMINAL
