"""The job records' part of `run.py check`: every record verified, every job number unique.

| finding                | meaning                                                        |
|------------------------|----------------------------------------------------------------|
| `bad-job-record`       | job.json fails its checksum, names another job, or lacks fields: the job is refused (pipeline/store/job_record.py) |
| `duplicate-job-number` | two job records claim one number: both are refused, so neither job's results go out under the other's custom_ids |

Neither is repaired by `--fix`: which record is right needs a person (the
job's journal and its items' seqs hold its true number).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pipeline.store.check import Finding
from pipeline.store.job_record import RECORD_NAME, JobRecordError, read_job_record


def check_job_records(data_root: Path) -> list[Finding]:
    """Findings for the job records under `<data_root>/jobs` (read only)."""
    root = Path(data_root) / "jobs"
    if not root.is_dir():
        return []
    findings: list[Finding] = []
    claims: dict[int, list[str]] = defaultdict(list)
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            meta = read_job_record(directory)
        except FileNotFoundError:
            continue  # not a job (a job being created has no record yet)
        except (OSError, JobRecordError) as exc:
            reason = str(exc).removeprefix(f"{directory / RECORD_NAME}: ")
            findings.append(Finding(directory / RECORD_NAME, "bad-job-record", reason))
            continue
        claims[int(meta["job_no"])].append(directory.name)
    for job_no, names in sorted(claims.items()):
        if len(names) > 1:
            findings.append(
                Finding(
                    root,
                    "duplicate-job-number",
                    f"job number {job_no} is claimed by jobs {', '.join(names)}: all are refused",
                )
            )
    return findings
