"""A batch record: what `batches/<batch_id>/batch.json` holds, typed.

The JSON is the one the API has always written (the keys below, by these
names), so a record written by an older broker loads, and one this code
writes is read by it: `from_json` takes any of the keys as missing (their
defaults), `to_json` writes them all, and keys this code does not know are
kept as they were (`extra`).

| key | what |
|-----|------|
| `id`, `owner`, `input_file_id`, `endpoint`, `completion_window`, `metadata`, `model` | the create request and who made it |
| `status` | OpenAI's status (pipeline/core/job_states.py `BatchStatus`) |
| `created_at`, `expires_at`, `<status>_at` | unix seconds: OpenAI's timestamps |
| `request_counts`, `usage`, `errors`, `output_file_id`, `error_file_id` | what the Batch object shows |
| `local_errors` | lines the driver kept out of the job (another endpoint's), counted as failed |
| `submit_path`, `submitted` | the file sent as the job, and whether every line of it is in the job |
| `ending` | a batch ending while validating: its end status (and errors, for `failed`) |
| `job_cancelled`, `expiring` | its job was cancelled (at the deadline, for `expiring`) |
| `ended_as` | the job's end state, once it ended (the batch's end status follows it) |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.core.job_states import BatchStatus, JobState

STAMPED = (  # the statuses with a `<status>_at` timestamp, in OpenAI's order
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLING,
    BatchStatus.CANCELLED,
)


@dataclass(frozen=True)
class Ending:
    """How a batch still validating ends, once its job (if any) is closed."""

    status: BatchStatus
    errors: list[dict[str, Any]] | None = None  # the validation's errors, for `failed`

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": str(self.status)}
        if self.errors is not None:
            out["errors"] = self.errors
        return out


@dataclass
class BatchRecord:
    id: str
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int | None
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, str] | None = None
    model: str | None = None
    request_counts: dict[str, int] = field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )
    usage: dict[str, int] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    # the driver's own
    local_errors: int = 0
    submit_path: str | None = None
    submitted: bool = True
    ending: Ending | None = None
    job_cancelled: bool = False
    expiring: bool = False
    ended_as: JobState | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of another version, kept

    @property
    def ended(self) -> bool:
        return self.status.terminal

    def stamp(self, status: BatchStatus) -> int | None:
        """The `<status>_at` timestamp (None: not reached)."""
        return getattr(self, f"{status}_at")

    def move_to(self, status: BatchStatus, now_s: int) -> None:
        """Take `status`, stamped `now_s` (unix seconds)."""
        self.status = status
        setattr(self, f"{status}_at", now_s)

    def stamps(self) -> dict[str, int | None]:
        return {f"{s}_at": self.stamp(s) for s in STAMPED}

    def accepts_partial(self, key: str) -> bool:
        """Whether metadata `key` chose to run the good lines despite bad ones."""
        value = str((self.metadata or {}).get(key, ""))
        return value.lower() in ("true", "1", "yes")

    # ---- the JSON on disk ------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: bytes) -> BatchRecord:
        raw = orjson.loads(data)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        known["status"] = BatchStatus(known.get("status", BatchStatus.VALIDATING))
        if known.get("ended_as") is not None:
            known["ended_as"] = JobState(known["ended_as"])
        if known.get("ending") is not None:
            ending = known["ending"]
            known["ending"] = Ending(BatchStatus(ending["status"]), ending.get("errors"))
        for flag, default in (("submitted", True), ("job_cancelled", False), ("expiring", False)):
            known[flag] = bool(known[flag]) if known.get(flag) is not None else default
        known["local_errors"] = int(known.get("local_errors") or 0)
        if known.get("request_counts") is None:
            known.pop("request_counts", None)
        extra = {k: v for k, v in raw.items() if k not in names}
        return cls(**known, extra=extra)

    def to_json(self) -> bytes:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        extra = out.pop("extra")
        out["status"] = str(self.status)
        out["ended_as"] = None if self.ended_as is None else str(self.ended_as)
        out["ending"] = None if self.ending is None else self.ending.to_json()
        return orjson.dumps({**extra, **out})
