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
gives it. The words are OpenAI's where OpenAI has the state; `queued` (no
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

# The OpenAI Batch status of a batch whose job is in each state.
OPENAI_STATUS: dict[JobState, str] = {
    JobState.VALIDATING: "validating",
    JobState.QUEUED: "in_progress",
    JobState.IN_PROGRESS: "in_progress",
    JobState.CANCELLING: "cancelling",
    JobState.COMPLETED: "completed",
    JobState.CANCELLED: "cancelled",
    JobState.EXPIRED: "expired",
}


def openai_status(state: str) -> str:
    """The OpenAI Batch status of a job state (a JobState or its string)."""
    return OPENAI_STATUS[JobState(state)]


def is_terminal(state: str | None) -> bool:
    """True for a terminal state's string (or JobState); False for anything else."""
    return state in TERMINAL
