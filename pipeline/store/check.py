"""The consistency check of the logs: what `python run.py check` finds in segment files.

A finding is one line (`Finding`); a `CheckReport` gathers them. The whole
check of a data dir, which also reads the jobs, the vector stores and the
acknowledged items that were lost, is composed on the top floor
(assembly/check.py), since it spans stores that live on higher floors.

`check_logs` walks both logs and reports, one line each: files that are not readable
segments (bad magic, newer version, damaged header, wrong size), markers in
no known state, advisory header counts that disagree with the markers,
torn tails, LIVE slots whose checksum fails, orphan temporary files and
stray files. With `fix`, it repairs what can be repaired without losing an
acknowledged item (recount and rewrite headers, cut torn tails, remove
orphan temporary files, isolate damaged input segments as a broker start
does: pipeline/store/salvage.py) and says what it did. Everything else is
reported and left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.store.datadir import DataDir
from pipeline.store.salvage import isolate, isolated_files
from pipeline.store.scan import (
    DamagedFile,
    SegmentSummary,
    bad_live_slots,
    iter_markers,
    scan_segment,
)
from pipeline.store.segment_format import SUFFIX, TMP_SUFFIX, known_markers

MAX_SLOTS_LISTED = 10


@dataclass(frozen=True)
class Finding:
    path: Path
    code: str
    message: str
    fixable: bool = False

    def line(self) -> str:
        return f"{self.path}: {self.code}: {self.message}"


@dataclass
class CheckReport:
    findings: list[Finding] = field(default_factory=list)  # as found, before any fix
    fixed: list[str] = field(default_factory=list)  # what --fix did
    remaining: list[Finding] = field(default_factory=list)  # still true at the end
    notes: list[str] = field(default_factory=list)  # true, and accounted for (isolated files)
    segments: int = 0
    lost: int = 0  # items --fix gave a corrupt_input error result: repaired, but not clean

    @property
    def clean(self) -> bool:
        return not self.remaining and not self.lost


def _listed(slots: np.ndarray) -> str:
    shown = ", ".join(str(int(s)) for s in slots[:MAX_SLOTS_LISTED])
    more = len(slots) - MAX_SLOTS_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _unknown_markers(path: Path, summary: SegmentSummary) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        found = []
        for first, markers in iter_markers(fd, summary.header):
            found.append(first + np.flatnonzero(~known_markers(markers)))
        return np.concatenate(found)
    finally:
        os.close(fd)


def check_segment(path: Path, acknowledged: frozenset = frozenset()) -> list[Finding]:
    """Every finding for one segment file (read only); `acknowledged`: (segment id, slot)
    of slots known to hold an acknowledged item that has no result (collector/losses.py)."""
    summary = scan_segment(path)
    if isinstance(summary, DamagedFile):
        return [Finding(path, summary.code, summary.reason.removeprefix(f"{path}: "))]
    findings = []
    if summary.unknown:
        slots = _unknown_markers(path, summary)
        findings.append(
            Finding(
                path,
                "unknown-marker",
                f"{len(slots)} marker(s) in no known state: slot {_listed(slots)}",
            )
        )
    on_disk_entries = summary.entries + len(summary.torn)
    if (summary.header_entries, summary.header_deleted) != (on_disk_entries, summary.dead):
        findings.append(
            Finding(
                path,
                "count-mismatch",
                f"header counts entries={summary.header_entries} deleted={summary.header_deleted}, "
                f"markers say entries={on_disk_entries} deleted={summary.dead}",
                fixable=True,
            )
        )
    held = [s for s in summary.torn if (summary.segment_id, s) in acknowledged]
    torn = [s for s in summary.torn if (summary.segment_id, s) not in acknowledged]
    if torn:
        findings.append(
            Finding(
                path,
                "torn-tail",
                f"{len(torn)} tail slot(s) with a LIVE marker and a bad checksum "
                f"(no acknowledged item is missing them): slot {_listed(np.array(torn))}",
                fixable=True,
            )
        )
    if held:
        findings.append(
            Finding(
                path,
                "rotten-tail",
                f"{len(held)} tail slot(s) fail their checksum but hold acknowledged items "
                f"with no result (rot, not a torn write): slot {_listed(np.array(held))}; "
                "--fix cuts them and gives the items corrupt_input error results",
                fixable=True,
            )
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        bad = bad_live_slots(fd, summary.header, summary.end)
    finally:
        os.close(fd)
    bad = bad[~np.isin(bad, summary.torn)]
    for slot in bad[:MAX_SLOTS_LISTED]:
        findings.append(
            Finding(
                path,
                "bad-checksum",
                f"LIVE slot {int(slot)} fails its checksum (corrupt; never dispatched)",
            )
        )
    if len(bad) > MAX_SLOTS_LISTED:
        findings.append(
            Finding(
                path,
                "bad-checksum",
                f"and {len(bad) - MAX_SLOTS_LISTED} more LIVE slots fail their checksum",
            )
        )
    return findings


def check_logs(
    data_dir: DataDir, report: CheckReport, acknowledged: frozenset, fix: bool = False
) -> None:
    """Check every file in both logs into `report`; with `fix`, repair what is safe to repair
    (isolate a damaged input segment, rewrite header counts, cut torn tails, remove orphan
    temporary files). `acknowledged` as for `check_segment`."""
    for directory in (data_dir.segments, data_dir.completion):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.name.endswith(TMP_SUFFIX):
                report.findings.append(
                    Finding(
                        path,
                        "orphan-temp",
                        "temporary file of an interrupted segment creation",
                        True,
                    )
                )
                if fix:
                    path.unlink(missing_ok=True)
                    report.fixed.append(f"{path}: removed orphan temporary file")
            elif path.name.endswith(SUFFIX):
                report.segments += 1
                findings = check_segment(path, acknowledged)
                report.findings.extend(findings)
                damaged = scan_segment(path) if fix and findings else None
                if isinstance(damaged, DamagedFile) and (moved := isolate(data_dir, damaged)):
                    into = f" to {moved.into.name}" if moved.into else ""
                    report.fixed.append(
                        f"{path}: isolated to {moved.path}; {moved.copied} readable item(s) "
                        f"copied{into}"
                    )
                elif fix and any(f.fixable for f in findings):
                    summary = scan_segment(path, repair=True)
                    if isinstance(summary, SegmentSummary):
                        cut = f", cut {len(summary.torn)} torn slot(s)" if summary.torn else ""
                        report.fixed.append(
                            f"{path}: rewrote header counts (entries={summary.entries}, "
                            f"deleted={summary.dead}), sealed{cut}"
                        )
            else:
                report.findings.append(
                    Finding(path, "stray-file", "not a segment file; left alone")
                )
    for path in isolated_files(data_dir):
        report.notes.append(
            f"{path}: damaged input segment, isolated; its unreadable items have (or, with --fix, get) corrupt_input error results"
        )
