"""The offline consistency check of a whole data dir (`python run.py check`).

It spans the stores of several floors, so it is composed here:

| part                                  | where                     |
|---------------------------------------|---------------------------|
| segment files of both logs: bad magic, newer version, damaged header, wrong size, unknown markers, header counts, torn tails, bad checksums, orphan temporary and stray files | pipeline/store/check.py |
| job records that fail their checksum or share a job number | ingest/job_check.py |
| the vector stores                     | collector/vectors/check.py |
| acknowledged items that have neither a result nor a readable LIVE slot (a DEAD marker with no result, an EMPTY marker over a valid slot, a rotten slot an acknowledged chunk covers) | collector/losses.py |
| the reuse index: damaged table, entries that fail their check or point at a gone or damaged record | pipeline/store/reuse_check.py |

With `fix`, it repairs what can be repaired without losing an acknowledged
item and says what it did; a lost item gets a `corrupt_input` error result,
so its job ends and says why, and the run is not clean. Everything else is
reported and left alone. Every crash and stress test ends by running it.
"""

from __future__ import annotations

from collector.losses import find_lost, record_lost
from collector.vectors.check import check_vectors
from ingest.job_check import check_job_records
from pipeline.store.check import CheckReport, Finding, check_logs
from pipeline.store.datadir import DataDir
from pipeline.store.reuse_check import check_reuse


def check_data_dir(data_dir: DataDir, fix: bool = False) -> CheckReport:
    """Check every store under the data dir; with `fix`, repair what is safe to repair."""
    report = CheckReport()
    lost = find_lost(data_dir)
    acknowledged = frozenset((seg, slot) for x in lost for seg, slot, _ in x.slots)
    check_logs(data_dir, report, acknowledged, fix)
    vector_findings, vector_fixed = check_vectors(data_dir.root, fix)
    report.findings.extend(vector_findings)
    report.fixed.extend(vector_fixed)
    report.findings.extend(check_job_records(data_dir.root))
    reuse_findings, reuse_fixed = check_reuse(data_dir.root, fix)
    report.findings.extend(reuse_findings)
    report.fixed.extend(reuse_fixed)
    for x in lost:
        report.findings.append(
            Finding(data_dir.root / "jobs" / x.job_id, "lost-items", x.line(), True)
        )
    if fix and report.fixed:
        lost = find_lost(data_dir, notes=False)  # isolating a file may have saved some
    if fix and lost:
        report.lost = record_lost(data_dir, lost)
        for x in lost:
            report.fixed.append(
                f"job {x.job_id}: {len(x.index)} lost item(s) given corrupt_input error results"
            )
    # After repairs, what is left is whatever a fresh read-only pass still finds.
    report.remaining = check_data_dir(data_dir).findings if report.fixed else report.findings
    return report
