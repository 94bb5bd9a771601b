"""What `run.py status --watch` gathers on each refresh, and from where.

| part of the dashboard      | source                                              | cost per refresh |
|----------------------------|-----------------------------------------------------|------------------|
| lanes, in flight, rates, workers, dead letters | BROKER_STATUS to dispatch (`dispatch.bind`) | one request |
| jobs: progress, rate, time left | JOB_STATUS to completion (`completion.bind`), one per job shown | one request per job |
| which jobs exist           | each job's record (id, number, created_ns; read once per job) and its `finished` mark (ns; one read per unfinished job), through pipeline/store/job_files.py | a directory listing |
| recent restarts            | the supervisor's report, `<data_dir>/supervisor.json` (pipeline/process/supervisor_report.py): its `deaths` | one read |

The data dir is read only when the dashboard runs where the broker does
(`--config`, and not `--broker`); elsewhere jobs and restarts are left out,
with a note saying why. Nothing here writes anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.job_state import with_in_flight
from collector.results_client import DispatchClient, ResultsClient
from pipeline.core.errors import BrokerUnavailableError, FabricError, IngestError
from pipeline.process.supervisor_report import read_report
from pipeline.store.job_files import JobFiles
from pipeline.transport.security import ClientCurve

FINISHED_SHOWN_S = 300.0  # a finished job stays on the dashboard this long
JOBS_SHOWN = 8
RESTARTS_SHOWN = 5


@dataclass(frozen=True)
class JobEntry:
    job_id: str
    job_no: int
    created_ns: int
    finished_ns: int | None


@dataclass(frozen=True)
class Restart:
    at_ns: int  # when the supervisor saw the death (wall clock)
    stage: str
    text: str  # e.g. "stage worker-0 died (signal SIGKILL); restarting it in 0.2 s"


@dataclass
class Snapshot:
    """One refresh: what dispatch and completion said, and what the data dir holds."""

    taken_ns: int
    broker: dict[str, Any] | None = None  # BROKER_INFO; None when dispatch did not answer
    broker_error: str | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)  # JOB_INFO of each job shown
    jobs_hidden: int = 0  # jobs not shown (beyond JOBS_SHOWN)
    jobs_note: str | None = None  # why jobs are missing or incomplete
    restarts: list[Restart] = field(default_factory=list)
    restarts_note: str | None = None
    job_names: dict[int, str] = field(default_factory=dict)  # job number -> job id


class JobDirectory:
    """The jobs under `<data_dir>/jobs/`, as the front and completion stage left them."""

    def __init__(self, data_root: Path) -> None:
        self.files = JobFiles(data_root)
        self._known: dict[str, JobEntry] = {}

    def entries(self) -> list[JobEntry]:
        names = self.files.names()
        for name in names:
            entry = self._known.get(name)
            if entry is not None and entry.finished_ns is not None:
                continue  # finished for good: nothing changes any more
            if entry is None:
                try:
                    meta = self.files.read_record(name)
                    entry = JobEntry(name, int(meta["job_no"]), int(meta["created_ns"]), None)
                except (OSError, IngestError):
                    continue  # being created (job.json is written atomically) or not a job
            finished = self.files.finished_ns(name)
            if finished is not None:
                entry = JobEntry(entry.job_id, entry.job_no, entry.created_ns, finished)
            self._known[name] = entry
        for gone in set(self._known) - set(names):
            del self._known[gone]
        return list(self._known.values())

    def shown(self, now_ns: int) -> tuple[list[JobEntry], int]:
        """Unfinished jobs (oldest first), then those finished lately (newest first); and how
        many more there were than JOBS_SHOWN."""
        entries = self.entries()
        active = sorted((e for e in entries if e.finished_ns is None), key=lambda e: e.created_ns)
        recent = sorted(
            (
                e
                for e in entries
                if e.finished_ns is not None and now_ns - e.finished_ns < FINISHED_SHOWN_S * 1e9
            ),
            key=lambda e: -e.finished_ns,
        )
        every = active + recent
        return every[:JOBS_SHOWN], max(0, len(every) - JOBS_SHOWN)

    def names(self) -> dict[int, str]:
        return {e.job_no: e.job_id for e in self._known.values()}


def _read_ns(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def recent_restarts(data_root: Path, limit: int = RESTARTS_SHOWN) -> list[Restart]:
    """The last `limit` stage deaths of the broker's current life, oldest first, from the
    supervisor's report; [] when there is none."""
    report = read_report(data_root)
    if report is None:
        return []
    found = []
    for death in report.get("deaths", [])[-limit:]:
        wait = death.get("restart_in_s")
        then = "the broker stops" if wait is None else f"restarting it in {wait:.1f} s"
        text = f"stage {death['stage']} died ({death['how']}); {then}"
        found.append(Restart(int(death["at_ns"]), death["stage"], text))
    return found


class Sources:
    """Gathers one Snapshot per call; each request is tried once, so a refresh never stalls
    longer than `timeout_s` per address."""

    def __init__(
        self,
        dispatch_address: str,
        completion_address: str | None,
        data_root: Path | None,
        timeout_s: float,
        only_job: str | None = None,
        curve: ClientCurve | None = None,
    ) -> None:
        self.dispatch_address = dispatch_address
        self.curve = curve  # CURVE keys for both addresses (pipeline/transport/security.py)
        self.only_job = only_job
        self.completion_address = completion_address
        self.timeout_s = timeout_s
        self.jobs = JobDirectory(data_root) if data_root is not None else None
        self.data_root = Path(data_root) if data_root is not None else None
        self._dispatch: DispatchClient | None = None
        self._completion: ResultsClient | None = None

    def snapshot(self) -> Snapshot:
        snap = Snapshot(taken_ns=time.time_ns())
        try:
            snap.broker = self._dispatch_client().broker_status()
        except BrokerUnavailableError:
            self._drop_dispatch()
            snap.broker_error = f"broker not reachable at {self.dispatch_address}, retrying"
        except FabricError as exc:
            snap.broker_error = f"{exc}; retrying"
        self._add_jobs(snap)
        if self.data_root is not None:
            snap.restarts = recent_restarts(self.data_root)
        else:
            snap.restarts_note = "restarts need the broker's data dir (run with --config there)"
        return snap

    def _add_jobs(self, snap: Snapshot) -> None:
        if self.jobs is None or self.completion_address is None:
            snap.jobs_note = "jobs need the broker's data dir (run with --config there)"
            return
        shown, snap.jobs_hidden = self.jobs.shown(snap.taken_ns)
        snap.job_names = self.jobs.names()
        if self.only_job is not None:
            shown = [JobEntry(self.only_job, 0, 0, None)]  # completion says whether it exists
            snap.jobs_hidden = 0
        for entry in shown:
            try:
                info = self._completion_client().job_status(entry.job_id)
                snap.jobs.append(with_in_flight(info, snap.broker))
            except BrokerUnavailableError:
                self._drop_completion()
                snap.jobs_note = f"completion not reachable at {self.completion_address}"
                return
            except FabricError as exc:  # e.g. the job's files went away meanwhile
                snap.jobs.append({"job": entry.job_id, "state": "unknown", "note": str(exc)})

    def _dispatch_client(self) -> DispatchClient:
        if self._dispatch is None:
            self._dispatch = DispatchClient(
                self.dispatch_address, self.timeout_s, attempts=1, curve=self.curve
            )
        return self._dispatch

    def _completion_client(self) -> ResultsClient:
        if self._completion is None:
            self._completion = ResultsClient(
                self.completion_address, self.timeout_s, attempts=1, curve=self.curve
            )
        return self._completion

    def _drop_dispatch(self) -> None:
        """Forget a client that got no answer: a late reply must not land in the next refresh."""
        if self._dispatch is not None:
            self._dispatch.close()
            self._dispatch = None

    def _drop_completion(self) -> None:
        if self._completion is not None:
            self._completion.close()
            self._completion = None

    def close(self) -> None:
        self._drop_dispatch()
        self._drop_completion()
