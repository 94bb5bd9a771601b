"""The completion stage's read-only view of jobs, from the files the front writes.

The front owns `jobs/<job_id>/job.json` and `jobs/<job_id>/chunks.log`
(their formats: pipeline/store/job_files.py); the completion stage only reads them,
incrementally, to learn a job's number, its total once every chunk is
committed, the lines ingest rejected (each becomes an error result), and the
`custom_id` of an item when a results client asks. The completion stage owns
one file here, the job's `cancel` mark (pipeline/store/job_files.py): a cancelled
job's queued items are retired with a `cancelled` error result.

Memory stays small for big jobs: a view keeps, per committed chunk, where
its commit record lies in the journal, and loads the custom_ids of a few
chunks at a time (results are delivered roughly in order), with the names
their lines gave their models where a line gave an alias (`names`, the job's
table of them, and `given_names`: ingest/model_aliases.py).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.item_seq import PART_BASE
from pipeline.core.job_limits import Stop, record_limits
from pipeline.core.job_states import JobState
from pipeline.core.line_table import LineTable
from pipeline.store.job_files import (
    ChunkProgress,
    JobFiles,
    journal_record_at,
    journal_records,
)
from pipeline.store.job_record import DELIVER_FILE, JobRecordError, record_priority

CHUNKS_CACHED = 16


class JobView:
    """One job as the front recorded it; `refresh()` reads what was appended since."""

    def __init__(self, files: JobFiles, job_id: str) -> None:
        self.files = files
        self.directory = files.directory(job_id)
        meta = files.read_record(job_id)  # JobRecordError: a damaged record is refused
        self.job_id: str = meta["job_id"]
        self.job_no: int = int(meta["job_no"])
        self.created_ns: int = int(meta["created_ns"])
        self.deliver: str = meta.get("deliver", DELIVER_FILE)  # ingest.jobs.parse_deliver
        self.priority: int = record_priority(meta)  # at submit; a client may change it
        self.notify: str = str(meta.get("notify", ""))  # `submit --notify URL`, or ""
        self.limits = record_limits(meta)  # its caps (pipeline/core/job_limits.py)
        self.reuse = bool(meta.get("reuse", False))  # `submit --reuse` (ingest/reuse_keys.py)
        self.found: list[list[Any]] = []  # its commit records' `reused` lines, not yet taken
        self.no_fingerprint: dict[str, str] = {}  # `nofp`: model -> why its lines never reuse
        self._keys: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.journal = files.journal_path(job_id)
        self.offset = 0
        self.progress = ChunkProgress(keep_errors=False)
        self.first_lines: dict[int, int] = {}  # first line of a committed chunk -> chunk
        self.rejected: list[list[Any]] = []  # [line, custom_id, code, message], not yet taken
        self.lines = LineTable()  # the fan-out lines of committed chunks
        self._ids: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._spans = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # committed (first, last)
        self.names: list[str] = []  # the aliases the job's lines gave, in order first recorded
        self._name_numbers: dict[str, int] = {}  # alias -> its place in `names`, from 1
        self.refresh()

    @property
    def all_committed(self) -> bool:
        return self.progress.all_committed

    @property
    def stored(self) -> int:
        return self.progress.stored

    @property
    def rejected_count(self) -> int:
        return self.progress.rejected

    @property
    def front_state(self) -> JobState:
        return self.progress.state

    @property
    def total(self) -> int | None:
        """Lines in the job, once every chunk is committed (None while it is still submitted)."""
        return self.progress.total

    @property
    def cancel_path(self) -> Path:
        return self.files.cancel_path(self.job_id)

    @property
    def cancelled(self) -> bool:
        return self.files.is_cancelled(self.job_id)

    @property
    def cancelled_at_deadline(self) -> bool:
        """Cancelled because its deadline passed (it ends `expired`, not `cancelled`)."""
        return self.files.cancelled_at_deadline(self.job_id)

    @property
    def paused(self) -> bool:
        return self.files.is_paused(self.job_id)

    @property
    def current_priority(self) -> int:
        """The last priority a client set (collector/completion/control.py), else the
        record's (default 0)."""
        changed = self.files.priority(self.job_id)
        return changed if changed is not None else self.priority

    @property
    def stopped(self) -> Stop | None:
        """The limit that stopped the job (its cancel mark says which), or None."""
        return Stop.from_mark(self.files.cancel_words(self.job_id))

    def refresh(self) -> None:
        records, self.offset = journal_records(self.journal, self.offset)
        for record, span in records:
            if self.progress.apply(record, span):
                self.first_lines[int(record["first"])] = record["c"]
                self.rejected.extend(record["errors"])
                self.found.extend(record.get("reused", ()))
                self.no_fingerprint.update(record.get("nofp", {}))
                self.lines.add(record.get("parts", ()))
                for name in record.get("names", ()):
                    self._name_number(name)

    def known(self, indexes: np.ndarray) -> np.ndarray:
        """Per item index: is its line in a committed chunk? A chunk's items can be placed,
        dispatched and computed before its commit record names their custom_ids (the front
        died in between; a resubmit commits them later), so their results wait for it: sent
        before, they would go out with no custom_id. (An index at PART_BASE and above is a
        fan-out part, for the line table to say.)"""
        index = np.asarray(indexes, np.int64)
        firsts, lasts = self._committed()
        lines = index + 1
        at = np.searchsorted(firsts, lines, side="right") - 1
        inside = (at >= 0) & (lines <= lasts[np.maximum(at, 0)]) if len(firsts) else at >= 0
        return inside | (index >= PART_BASE)

    def _committed(self) -> tuple[np.ndarray, np.ndarray]:
        """(first line, last line) of each committed chunk, sorted; made again only when a
        chunk was committed since (a results page asks for every page)."""
        if len(self._spans[0]) != len(self.first_lines):
            firsts = np.array(sorted(self.first_lines), np.int64)
            chunks = self.progress.chunks
            lasts = [chunks[self.first_lines[f]].last for f in firsts.tolist()]
            self._spans = (firsts, np.array(lasts, np.int64))
        return self._spans

    @property
    def reused_count(self) -> int:
        """Lines its commit records say took a stored result (result reuse)."""
        return self.progress.reused

    def request_keys(self, indexes) -> np.ndarray:
        """The request key (ingest/reuse_keys.py) of each item index as [n, 2] u8, from its
        chunk's commit record (`rk`); zeros for one without (not deterministic, a fan-out
        part, or its chunk not committed yet)."""
        index = np.asarray(indexes, np.int64)
        out = np.zeros((len(index), 2), np.uint64)
        lines = index + 1
        firsts = self._committed()[0]
        at = np.searchsorted(firsts, lines, side="right") - 1
        for k in np.unique(at).tolist():
            if k < 0:
                continue
            mine = np.flatnonzero(at == k)
            chunk_lines, keys = self._keys_of(self.first_lines[int(firsts[k])])
            if not len(chunk_lines):
                continue
            pos = np.minimum(np.searchsorted(chunk_lines, lines[mine]), len(chunk_lines) - 1)
            hit = chunk_lines[pos] == lines[mine]
            out[mine[hit]] = keys[pos[hit]]
        return out

    def _keys_of(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._keys.get(chunk)
        if cached is None:
            record = journal_record_at(self.journal, self.progress.chunks[chunk].span)
            rk = record.get("rk") or {"lines": [], "keys": ""}
            text = rk["keys"]
            pairs = [
                (int(text[i : i + 16], 16), int(text[i + 16 : i + 32], 16))
                for i in range(0, len(text), 32)
            ]
            lines = np.asarray(rk["lines"], np.int64)
            keys = np.array(pairs, np.uint64).reshape(-1, 2)
            order = np.argsort(lines, kind="stable")
            cached = self._keys[chunk] = (lines[order], keys[order])
            while len(self._keys) > CHUNKS_CACHED:
                self._keys.popitem(last=False)
        return cached

    def take_rejected(self) -> list[list[Any]]:
        taken, self.rejected = self.rejected, []
        return taken

    def custom_ids(self, indexes) -> list[str | None]:
        """The custom_id of each item index (a list or an int array; None when the line had no
        readable one)."""
        if not len(indexes):
            return []
        out = np.full(len(indexes), None, dtype=object)
        for mine, want, (_, ids, extra, _), pos, hit in self._by_chunk(indexes):
            out[mine[hit]] = ids[pos[hit]]  # one take per chunk (a page is 4096 ids)
            for i, line in zip(mine[~hit].tolist(), want[~hit].tolist(), strict=True):
                out[i] = extra.get(line)  # rejected lines: their custom_id, if readable
        return out.tolist()

    def given_names(self, indexes) -> np.ndarray | None:
        """Per item index, the name its line gave its model: 0 its model's own, k `names[k - 1]`
        (int64); None when every one gave its model's own name, as in every job without
        aliases, which costs nothing here."""
        if not self.names or not len(indexes):
            return None
        out = np.zeros(len(indexes), np.int64)
        for mine, _, (_, _, _, given), pos, hit in self._by_chunk(indexes):
            if given is not None:
                out[mine[hit]] = given[pos[hit]]
        return out if out.any() else None

    def _by_chunk(self, indexes):
        """For each committed chunk that item indexes fall in: (their rows, their lines, the
        chunk's `_ids_of`, their positions in its stored lines, whether each is stored there)."""
        lines = np.asarray(indexes, np.int64) + 1
        firsts = self._committed()[0]
        at = np.searchsorted(firsts, lines, side="right") - 1
        for k in np.unique(at).tolist():
            if k < 0:
                continue
            mine = np.flatnonzero(at == k)
            stored = self._ids_of(self.first_lines[int(firsts[k])])
            chunk_lines, want = stored[0], lines[mine]
            pos = np.minimum(np.searchsorted(chunk_lines, want), max(len(chunk_lines) - 1, 0))
            hit = (chunk_lines[pos] == want) if len(chunk_lines) else np.zeros(len(want), bool)
            yield mine, want, stored, pos, hit

    def _name_number(self, name: str) -> int:
        number = self._name_numbers.get(name)
        if number is None:
            self.names.append(name)
            number = self._name_numbers[name] = len(self.names)
        return number

    def _ids_of(
        self, chunk: int
    ) -> tuple[np.ndarray, np.ndarray, dict[int, str], np.ndarray | None]:
        """A committed chunk's stored lines (sorted), their custom_ids (an object array),
        rejected ones', and the name each stored line gave its model (int64, as
        `given_names`; None when every one gave its model's own name)."""
        cached = self._ids.get(chunk)
        if cached is not None:
            self._ids.move_to_end(chunk, last=False)
            return cached
        record = journal_record_at(self.journal, self.progress.chunks[chunk].span)
        lines = np.asarray(record["lines"], np.int64)
        ids = np.empty(len(record["ids"]), dtype=object)
        ids[:] = record["ids"]
        given = None
        if record.get("names"):
            numbers = np.array([0, *map(self._name_number, record["names"])], np.int64)
            which = record.get("name_ix")  # absent: every stored line gave names[0]
            ix = np.ones(len(lines), np.int64) if which is None else np.asarray(which, np.int64)
            given = numbers[ix]
        if len(lines) > 1 and (np.diff(lines) < 0).any():
            order = np.argsort(lines, kind="stable")
            lines, ids = lines[order], ids[order]
            given = given[order] if given is not None else None
        extra = {int(line): cid for line, cid, *_ in record["errors"] if cid is not None}
        cached = (lines, ids, extra, given)
        self._ids[chunk] = cached
        self._ids.move_to_end(chunk, last=False)
        while len(self._ids) > CHUNKS_CACHED:
            self._ids.popitem(last=True)
        return cached


class JobIndex:
    """Job number -> job id for every job under `jobs/`, and the views of active jobs."""

    def __init__(self, data_root: Path) -> None:
        self.files = JobFiles(data_root)
        self._by_no: dict[int, str] = {}
        self._named: set[str] = set()  # job directories whose number is in _by_no
        self.views: dict[str, JobView] = {}
        self.refused: dict[str, str] = {}  # job id -> why its record is not trusted
        self._claims: dict[int, set[str]] = collections.defaultdict(set)  # number -> job ids

    def view(self, job_id: str) -> JobView | None:
        """The job's view; None for no such job, or one refused (damaged record, or a number
        another job claims too: `refused` says why)."""
        view = self.views.get(job_id)
        if view is None:
            if job_id in self.refused or not self.files.has_record(job_id):
                return None
            try:
                view = JobView(self.files, job_id)
            except JobRecordError as exc:
                self.refused[job_id] = str(exc)
                return None
            if not self._claim(view.job_no, job_id):
                return None
            self.views[job_id] = view
        return view

    def _claim(self, job_no: int, job_id: str) -> bool:
        """Note that `job_id` has number `job_no`; False (both refused) if another job has it."""
        claims = self._claims[job_no]
        claims.add(job_id)
        self._named.add(job_id)
        if len(claims) == 1:
            self._by_no[job_no] = job_id
            return True
        self._by_no.pop(job_no, None)
        for name in claims:
            self.refused[name] = (
                f"job number {job_no} is claimed by the records of jobs {', '.join(sorted(claims))}; "
                "all of them are refused so that no results are delivered under the wrong job"
            )
            self.views.pop(name, None)
        return False

    def job_id(self, job_no: int) -> str | None:
        """The id of job number `job_no`. A number not known yet (a job created a moment ago)
        lists the jobs directory and reads only the job.json files of directories never read
        before, so a miss costs a listing, not a read of every job ever run."""
        found = self._by_no.get(job_no)
        if found is None:
            for name in self.files.names():
                if name in self._named:
                    continue
                try:
                    number = int(self.files.read_record(name)["job_no"])
                except OSError:
                    continue  # not a job, or one still being created: read again next time
                except JobRecordError as exc:
                    self.refused[name] = str(exc)  # damaged: never mapped to a number
                    self._named.add(name)
                    continue
                self._claim(number, name)
            found = self._by_no.get(job_no)
        return found

    def forget(self, job_id: str) -> None:
        self.views.pop(job_id, None)


def write_cancel(view: JobView, at_deadline: bool = False, stop: Stop | None = None) -> None:
    """Record durably that the job is cancelled (job number and wall time; `at_deadline`:
    because its deadline passed; `stop`: because it passed that limit)."""
    why = stop.mark_text() if stop is not None else ""
    view.files.mark_cancelled(view.job_id, view.job_no, time.time_ns(), at_deadline, why)
