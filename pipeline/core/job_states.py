"""A job's states: the one list of what `status`, the results clients and the sinks may see.

| state         | produced by                                               | terminal |
|---------------|-----------------------------------------------------------|----------|
| `validating`  | the front, while a job's chunks are still arriving         | no       |
| `queued`      | completion, once every chunk is committed and no result yet | no       |
| `in_progress` | completion (some results) or dispatch (items with workers)  | no       |
| `cancelling`  | completion: cancelled, items still being retired           | no       |
| `completed`   | completion: every item has a result or an error            | yes      |
| `cancelled`   | completion: cancelled and every item retired               | yes      |
| `expired`     | completion: cancelled at its deadline and every item retired; or finished, then removed after its retention | yes      |

A terminal state never changes again. Values are the strings the wire and
`job.json` carry, so a `JobState` compares equal to its string.

Every door names a job's state with these words: `run.py status JOB`,
`status --watch`, `results` and `batch` show the state itself, and the HTTP
API shows a batch whose job has one the OpenAI Batch status `OPENAI_STATUS`
gives it (`BatchStatus`: OpenAI's statuses, one enum). The words are OpenAI's where OpenAI has the state; `queued` (no
item done or with a worker yet) is the broker's own, and OpenAI's
`in_progress`. OpenAI's `failed` (the input file did not validate) and
`finalizing` (the output files being written) are the HTTP API's own steps
around a job (api/batch_driver.py).
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

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.COMPLETED, JobState.CANCELLED, JobState.EXPIRED})


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
}


def openai_status(state: str) -> BatchStatus:
    """The OpenAI Batch status of a job state (a JobState or its string)."""
    return OPENAI_STATUS[JobState(state)]


def is_terminal(state: str | None) -> bool:
    """True for a terminal state's string (or JobState); False for anything else."""
    return state in TERMINAL
