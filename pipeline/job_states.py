"""A job's states: the one list of what `status`, the results clients and the sinks may see.

| state         | produced by                                               | terminal |
|---------------|-----------------------------------------------------------|----------|
| `validating`  | the front, while a job's chunks are still arriving         | no       |
| `queued`      | completion, once every chunk is committed and no result yet | no       |
| `in_progress` | completion (some results) or dispatch (items with workers)  | no       |
| `cancelling`  | completion: cancelled, items still being retired           | no       |
| `completed`   | completion: every item has a result or an error            | yes      |
| `cancelled`   | completion: cancelled and every item retired               | yes      |
| `expired`     | completion: finished, then removed after its retention     | yes      |

A terminal state never changes again. Values are the strings the wire and
`job.json` carry, so a `JobState` compares equal to its string.
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


def is_terminal(state: str | None) -> bool:
    """True for a terminal state's string (or JobState); False for anything else."""
    return state in TERMINAL
