"""Loss accounting: acknowledged items that have neither a result nor a readable LIVE slot.

An item is acknowledged once its chunk's commit record is in the job's
journal (`jobs/<job_id>/chunks.log`, ingest/jobs.py: the commit's `lines`,
index = line - 1). From then on, until its job finishes, it must be in one
of two places: a LIVE input slot that can be trusted (marker exactly LIVE,
checksum valid, seq agreeing with job and index: pipeline/store/salvage.py), or
the job's completion log (a result or an error result, dead letters
included). An item in neither is lost: its slot was damaged (a truncated
file, a torn or rotten slot, a marker flipped to DEAD or EMPTY without a
result). Nothing can bring its input back, so `record_lost()` gives it an
error result `corrupt_input: ...` in the completion log, the way a rejected
line gets one (CompletionLog.record_errors), and its job can end saying why.

Only unfinished jobs are accounted (a finished job's results may already be
collected). Run with the data dir locked and no stage running: at broker
start after recovery isolated a damaged file or cut a torn tail, or while an earlier start
left `losses-owed` (written before it moved a damaged file aside, removed once the error
results are durable: moved aside, the file no longer calls for an accounting, and a power
cut or kill before the results left its items lost for good) (`run.py` composes it), and by
`run.py check` (`--fix` records the losses).
It reads every LIVE slot of the input log once, so it runs only then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from collector.completion.results_log import CompletionLog
from pipeline.core.errors import SegmentError
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.core.item_seq import job_of, seq_of
from pipeline.store.datadir import DataDir
from pipeline.store.durable import fsync_dir, write_whole
from pipeline.store.job_files import JOURNAL_FILE, JobFiles, acknowledged_indexes
from pipeline.store.job_record import JobRecordError
from pipeline.store.salvage import isolate, iter_slots, trusted_header
from pipeline.store.segment_format import (
    DEAD,
    EMPTY,
    HEADER_BYTES,
    LIVE,
    STATE_MASK,
    SUFFIX,
    live_markers,
)

LOST_REASON = (
    f"{ItemErrorCode.CORRUPT_INPUT}: the stored item was lost to damage in the input log "
    "(a damaged segment, a torn or rotten slot or marker); resubmit it"
)
MAX_NOTES = 10


@dataclass
class LostItems:
    """One job's lost items, and what the input log still says about some of them."""

    job_id: str
    job_no: int
    index: np.ndarray  # int64, sorted
    slots: list[tuple[int, int, str]] = field(default_factory=list)  # (segment, slot, what)

    def line(self) -> str:
        shown = ", ".join(str(int(i)) for i in self.index[:MAX_NOTES])
        more = f" and {len(self.index) - MAX_NOTES} more" if len(self.index) > MAX_NOTES else ""
        notes = [f"segment {seg} slot {slot}: {what}" for seg, slot, what in self.slots]
        where = f"; {'; '.join(notes)}" if notes else ""
        return (
            f"job {self.job_id}: {len(self.index)} acknowledged item(s) with no result and no "
            f"readable LIVE slot (index {shown}{more}){where}"
        )


def acknowledged(directory: Path) -> np.ndarray:
    """Item indexes of every committed chunk of the job in `directory` (int64, sorted)."""
    return acknowledged_indexes(directory / JOURNAL_FILE)


def _unfinished_jobs(data_dir: DataDir) -> dict[int, tuple[str, Path]]:
    files = JobFiles(data_dir.root)
    jobs: dict[int, tuple[str, Path]] = {}
    claimed: set[int] = set()
    for name in files.names():
        if files.is_finished(name):
            continue
        directory = files.directory(name)
        try:
            meta = files.read_record(name)
        except (OSError, JobRecordError):
            continue  # not a job, or a refused one (ingest/job_check.py reports it)
        job_no = int(meta["job_no"])
        if job_no in claimed:  # two records, one number: both refused (ingest/job_check.py)
            jobs.pop(job_no, None)
            continue
        claimed.add(job_no)
        jobs[job_no] = (str(meta["job_id"]), directory)
    return jobs


def _input_files(data_dir: DataDir) -> list[Path]:
    if not data_dir.segments.is_dir():
        return []
    return sorted(
        p
        for p in data_dir.segments.iterdir()
        if p.name.startswith("in-") and p.name.endswith(SUFFIX)
    )


def _readable_seqs(data_dir: DataDir, job_nos: np.ndarray) -> np.ndarray:
    """Seqs of the jobs `job_nos` in trusted LIVE slots of the input log (damaged files:
    what can be trusted)."""
    found: list[np.ndarray] = []
    for _, _, markers, words, ok in _slots(data_dir, lambda states: states == LIVE):
        seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        keep = ok & live_markers(markers) & np.isin(job_of(seq), job_nos.astype(np.int64))
        found.append(seq[keep])
    return np.concatenate(found) if found else np.empty(0, np.uint64)


def _slots(data_dir: DataDir, wanted):
    """(header, slots, markers, words, trusted) chunks of every input file's slots whose
    marker state `wanted(states)` selects (pipeline.store.salvage.iter_slots)."""
    for path in _input_files(data_dir):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            header = trusted_header(path, os.pread(fd, HEADER_BYTES, 0), size)
            if header is None:
                continue  # nothing of it can be trusted
            for slots, markers, words, ok in iter_slots(fd, header, size, wanted):
                yield header, slots, markers, words, ok
        finally:
            os.close(fd)


NOTE = {
    DEAD: "marker DEAD but no result (rot, not a retire)",
    EMPTY: "marker EMPTY over a valid slot (rot, not a torn write)",
}


def _notes(data_dir: DataDir, lost_seqs: np.ndarray) -> dict[int, list[tuple[int, int, str]]]:
    """Per job number: what the input log says about its lost items (rotten markers, slots
    that fail their checksum but still name the item)."""
    notes: dict[int, list[tuple[int, int, str]]] = {}
    for header, slots, markers, words, ok in _slots(data_dir, lambda states: states >= 0):
        seq = np.ascontiguousarray(words[:, :2]).view("<u8").reshape(-1)
        for i in np.flatnonzero(np.isin(seq, lost_seqs)).tolist():
            state = int(markers[i] & STATE_MASK)
            if ok[i] and state in NOTE and markers[i] >> 16 == 0:
                what = NOTE[state]
            elif ok[i] and not live_markers(markers[i : i + 1])[0]:
                what = f"marker 0x{int(markers[i]):08x} in no known state"
            elif not ok[i] and state == LIVE:
                what = "LIVE slot fails its checksum (rot or a torn write of an acknowledged item)"
            else:
                continue
            mine = notes.setdefault(job_of(int(seq[i])), [])
            if len(mine) < MAX_NOTES:
                mine.append((header.segment_id, int(slots[i]), what))
    return notes


def find_lost(data_dir: DataDir, notes: bool = True) -> list[LostItems]:
    """Every unfinished job's acknowledged items with neither a result nor a readable slot."""
    jobs = _unfinished_jobs(data_dir)
    if not jobs:
        return []
    readable = _readable_seqs(data_dir, np.fromiter(jobs, np.uint64, len(jobs)))
    log = CompletionLog(data_dir, _no_input)
    lost: list[LostItems] = []
    try:
        for job_no, (job_id, directory) in sorted(jobs.items()):
            index = acknowledged(directory)
            if not len(index):
                continue
            seqs = seq_of(job_no, index)
            missing = ~np.isin(seqs, readable) & ~log.load_job(job_id).seen(index)
            if missing.any():
                lost.append(LostItems(job_id, job_no, index[missing]))
    finally:
        log.close()
    if notes and lost:
        seqs = np.concatenate([seq_of(x.job_no, x.index) for x in lost])
        found = _notes(data_dir, seqs)
        for x in lost:
            x.slots = found.get(x.job_no, [])
    return lost


def record_lost(data_dir: DataDir, lost: list[LostItems]) -> int:
    """Give every lost item a `corrupt_input` error result, durably; returns how many."""
    log = CompletionLog(data_dir, _no_input)
    stored = 0
    try:
        for x in lost:
            reasons = [LOST_REASON] * len(x.index)
            stored += log.record_errors(x.job_id, x.job_no, x.index, reasons)
        log.sync_outputs()
    finally:
        log.close()
    return stored


def _no_input(segment_id: int):
    raise SegmentError(
        f"input segment {segment_id}: loss accounting stores error results only and never "
        "retires an input slot"
    )


def after_recovery(data_dir: DataDir, damaged: list, torn_slots: int) -> list[LostItems]:
    """At broker start, before any stage: isolate damaged input segments (serving their
    trusted items from a new segment), then give every lost item its error result.

    `damaged`: recovery's DamagedFile list; `torn_slots`: how many torn slots it cut
    (a cut slot may have held an acknowledged item whose slot rotted). Returns the losses.
    """
    owed = data_dir.losses_owed
    inputs = [d for d in damaged if d.path.parent == data_dir.segments]
    if inputs or torn_slots:  # durable before the first file moves: a cut or kill between
        write_whole(owed, b"")  # the move and the error results leaves the mark, not the file
    isolated = [x for d in damaged if (x := isolate(data_dir, d)) is not None]
    if not (isolated or torn_slots or owed.exists()):
        return []
    lost = find_lost(data_dir, notes=False)
    if lost:
        record_lost(data_dir, lost)
    owed.unlink(missing_ok=True)
    fsync_dir(data_dir.root)
    return lost
