"""Moves each batch through OpenAI's states over the broker's own ingest and completion paths.

    validating --(lines checked, job submitted)--> in_progress --(job done, results
    fetched)--> finalizing --> completed
    validating --(bad lines, OpenAI's default)--> failed
    in_progress --(cancel)--> cancelling --> cancelled     (results made so far are kept)
    in_progress --(expires_at)--> expired                  (unfinished items: batch_expired lines)
    in_progress --(a limit passed)--> failed               (api/batch_limits.py: error_cap lines)

A batch ends in its job's end state (pipeline/core/job_states.py `OPENAI_STATUS`), so
`run.py status`, `status --watch` and HTTP say one word: at `expires_at` the job is
cancelled *at its deadline* and ends `expired`.

A batch is a broker job whose id is the batch id: while validating, the driver
sends the input's lines with the producer SDK as they check out
(api/batch_validation.py: the file is parsed once, and the broker starts on the
first lines while the last are checked; `Producer.submit_file` is acknowledged
once every item is durable; run again after a crash, it resumes with the chunks
already acknowledged) and fetches the results with the results client
(`ResultsClient.fetch`, which appends to the batch's output and error files,
fsyncs them and only then acknowledges each page: each custom_id lands once
across the two files, whatever crashes). There is no queue of its own: the
record says which step a batch is at, and every step is safe to repeat, so
after any kill the driver simply runs the step again.

Only api-0 runs the driver (the one writer of batch records). The job is created
with the batch's `expires_at` as its deadline, so dispatch serves earlier
deadlines first (a hint, docs/dispatch.md); expiry ends a batch at its deadline.

The driver reads no clock: `step(now)` is given the wall clock (unix seconds;
the api stage passes `time.time()`), which stamps the record, decides expiry
at `expires_at` and paces the fetches, so tests step it on a fake clock
(tests/test_api_driver.py). The record is typed (api/batch_record.py), the
statuses are `BatchStatus` (pipeline/core/job_states.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from api.batch_events import BatchEvents
from api.batch_files import BatchFiles
from api.batch_limits import job_limits, stopped_errors
from api.batch_record import BatchRecord, Ending
from api.batch_reuse import reuse_of, with_reused
from api.batch_store import ACCEPT_PARTIAL_KEY, ERRORS, OUTPUT, BatchStore
from api.batch_validation import Checked, check_and_send, error
from api.control_routes import priority_of
from api.file_store import FileStore, output_file_id
from collector.delivery.decoders import Decoder
from collector.results_client import ResultsClient
from ingest.submit_client import Producer
from pipeline.core.errors import FabricError
from pipeline.core.job_states import BatchStatus, JobState, is_terminal, openai_status

log = logging.getLogger("fabric.api")
FETCH_EVERY_S = 1.0  # a running batch's results are fetched this often (and when it ends)
CANCEL_WAIT_S = 5.0  # a job not known this long after its validation stopped is sent its lines
S = BatchStatus


def _due(now: float, since: float | None, every_s: float) -> bool:
    """Whether `every_s` passed since `since` (never set, or a wall clock set back: due)."""
    return since is None or not 0 <= now - since < every_s


class BatchDriver:
    """Advances every unfinished batch one step per `step(now)`; each step is idempotent."""

    def __init__(
        self,
        files: FileStore,
        batches: BatchStore,
        producers: tuple[Producer, Producer],
        results: ResultsClient,
        decoders: dict[str, Decoder] | None = None,
        events: BatchEvents | None = None,
    ) -> None:
        """`producers`: one for the broker's catalog on this thread, one for submissions on
        the submit thread (a ZeroMQ socket is used by one thread only); `decoders`: the
        models' (collector/delivery/decoders.py), for the text of generated results; `events`:
        the webhooks' outbox, told of each batch's end (api/batch_events.py)."""
        self.files = files
        self.batches = batches
        self.out = BatchFiles(files, batches)
        self.catalog, self.producer = producers
        self.results = results
        self.decoders = decoders or {}
        self.events = events
        self._fetched: dict[str, float] = {}  # batch id -> last fetch (`now`)
        self._done: set[str] = set()  # batches seen ended: not read again
        self._ended: dict[BatchStatus, int] = {}  # of those, how many in each end status
        # One submission at a time, on its own thread, so results keep being fetched and
        # counted meanwhile; the producer is used on that thread only.
        self._submitter = ThreadPoolExecutor(1, thread_name_prefix="submit")
        self._submitting: dict[str, Future] = {}
        # batches being validated, their lines sent as they check out (api/batch_validation.py)
        self._validating: dict[str, tuple[Future, threading.Event, Path]] = {}
        self._uncancelled: dict[str, float] = {}  # batch id -> first failed cancel of its job

    def close(self) -> None:
        for _, stop, _ in self._validating.values():
            stop.set()  # a pass cut here is run again at the next start
        self._submitter.shutdown(wait=True, cancel_futures=True)

    def step(self, now: float) -> dict[str, int]:
        """One pass over the unfinished batches at `now` (wall clock, unix seconds); returns
        how many batches are in each status."""
        counts = dict.fromkeys(map(str, BatchStatus), 0)
        for record in self.batches.all(skip=self._done):
            if record.ended:
                self._done.add(record.id)
                if self.events is not None:  # a kill may have come before its event's record
                    self.events.ended(record, now)
                self._ended[record.status] = self._ended.get(record.status, 0) + 1
                continue
            try:
                self.advance(record, now)
            except FabricError as exc:  # the broker is restarting: the next pass tries again
                log.warning("batch %s: %s; trying again", record.id, exc)
            counts[record.status] += 1
        for status, n in self._ended.items():
            counts[status] += n
        return counts

    def advance(self, record: BatchRecord, now: float) -> None:
        batch_id = record.id
        cancel_at = self.batches.cancel_requested(batch_id)
        expired = record.expires_at is not None and now >= record.expires_at
        if record.status == S.VALIDATING:
            if record.ending is not None:
                self._close_job_then_end(record, now)
            elif cancel_at is not None or expired:
                self._stop_validating(
                    record, S.CANCELLED if cancel_at is not None else S.EXPIRED, now
                )
            else:
                self._validate_and_submit(record, now)
            return
        if record.status == S.IN_PROGRESS and cancel_at is not None:
            self._cancel_job(batch_id)
            record.status, record.cancelling_at = S.CANCELLING, cancel_at
            self.batches.put(record)
        running = record.status in (S.IN_PROGRESS, S.CANCELLING)
        if running and expired and not record.expiring:
            self._cancel_job(batch_id, at_deadline=True)
            record.expiring = True
            self.batches.put(record)
        self._follow(record, now)

    # ---- validating ------------------------------------------------------------------------
    def _validate_and_submit(self, record: BatchRecord, now: float) -> None:
        """Start checking the batch's lines, sending them as its job as they check out (on the
        submit thread); once that pass ended, the batch is in_progress or failed."""
        batch_id = record.id
        running = self._validating.get(batch_id)
        if running is None:
            source = self.files.get(record.input_file_id)
            if source is None:
                errors = [error("file_not_found", None, "the input file was deleted")]
                self._fail(record, errors, now)
                return
            stop = threading.Event()
            path = self.files.content_path(source)
            future = self._submitter.submit(
                check_and_send,
                self.producer,
                path,
                batch_id,
                record.endpoint,
                accept_partial=record.accepts_partial(ACCEPT_PARTIAL_KEY),
                deadline=record.expires_at,
                stop=stop,
                job_priority=priority_of(record.metadata),
                limits=job_limits(record.metadata),
                reuse=reuse_of(record.metadata),
            )
            self._validating[batch_id] = (future, stop, path)
            log.info("batch %s: validating, its lines sent as job %s", batch_id, batch_id)
            return
        future, _, path = running
        if not future.done():
            return
        del self._validating[batch_id]
        try:
            checked = future.result()
        except FabricError as exc:  # the broker is restarting: validated again on the next pass
            log.warning("batch %s: validation stopped (%s); starting it again", batch_id, exc)
            return
        self._validated(record, checked, path, now)

    def _validated(self, record: BatchRecord, checked: Checked, path: Path, now: float) -> None:
        batch_id = record.id
        errors, wrong_url = checked.errors, checked.wrong_url
        if errors and not record.accepts_partial(ACCEPT_PARTIAL_KEY):
            self._end_validating(record, Ending(S.FAILED, errors), path, checked.job, now)
            return
        source_path = str(path)
        if wrong_url:  # kept out of the job: their error lines are written here, blank lines sent
            source_path = str(self.out.keep_out(batch_id, path, wrong_url, errors))
        record.move_to(S.IN_PROGRESS, int(now))
        record.output_file_id = output_file_id(batch_id, "output")
        record.local_errors = len(wrong_url)
        record.submit_path = source_path
        record.submitted = checked.sent_all
        record.request_counts = {"total": checked.lines, "completed": 0, "failed": len(errors)}
        self.out.register(record, "output")
        self.batches.put(record)
        if not checked.sent_all:  # the rest of the lines, from the copy without wrong urls
            self._submit(record)

    def _stop_validating(self, record: BatchRecord, status: BatchStatus, now: float) -> None:
        """A batch cancelled or expired while validating: its pass is stopped (the next passes
        look again until it has), then the batch ends as `status`."""
        batch_id = record.id
        running = self._validating.get(batch_id)
        job = self.catalog.job_status(batch_id)["exists"]
        path = None
        if running is not None:
            future, stop, path = running
            stop.set()
            if not future.done():
                return
            del self._validating[batch_id]
            job = job or future.exception() is not None or future.result().job
        elif job:
            source = self.files.get(record.input_file_id)
            path = self.files.content_path(source) if source is not None else None
        self._end_validating(record, Ending(status), path, job, now)

    def _end_validating(
        self, record: BatchRecord, ending: Ending, path: Path | None, job: bool, now: float
    ) -> None:
        """End a batch before in_progress (`ending`: its status, and errors for `failed`);
        `job`: some of its lines may be in its job, which is closed first."""
        if job and path is not None:
            record.ending, record.submit_path, record.submitted = ending, str(path), False
            self.batches.put(record)
            self._close_job_then_end(record, now)
            return
        if ending.status == S.FAILED:
            self._fail(record, ending.errors or [], now)
        elif ending.status == S.CANCELLED:
            record.cancelling_at = self.batches.cancel_requested(record.id)
            self._end(record, S.CANCELLED, now)
        else:
            self.out.expire_unsent(record)
            self._end(record, S.EXPIRED, now)

    def _close_job_then_end(self, record: BatchRecord, now: float) -> None:
        """A batch ending while validating, with lines in its job: the job is cancelled, then
        sent the rest of the file, so that it finishes (`cancelled`: the rest is not run) and
        its results expire like any job's, where a job never sent its last chunk would stay
        `validating` for ever; then the batch ends. Each step is safe to repeat."""
        batch_id, ending = record.id, record.ending
        assert ending is not None
        if not record.job_cancelled:
            try:
                self._cancel_job(batch_id, at_deadline=ending.status == S.EXPIRED)
            except FabricError as exc:  # no chunk of it committed yet: the next pass
                first = self._uncancelled.setdefault(batch_id, now)
                log.info("batch %s: its job cannot be cancelled yet (%s)", batch_id, exc)
                if _due(now, first, CANCEL_WAIT_S):  # none is coming: make the job
                    self._submitted(record)
                return
            self._uncancelled.pop(batch_id, None)
            record.job_cancelled = True
            self.batches.put(record)
        if self._submitted(record):
            record.ending = None
            self._end_validating(record, ending, None, False, now)

    def _submit(self, record: BatchRecord) -> None:
        """Start (or, after a restart, resume) sending the input as the batch's job."""
        batch_id = record.id
        if batch_id not in self._submitting:
            path = record.submit_path
            assert path is not None  # set when the input validated, before in_progress
            self._submitting[batch_id] = self._submitter.submit(
                self.producer.submit_file,
                path,
                batch_id,
                deadline=record.expires_at,
                job_priority=priority_of(record.metadata),
                limits=job_limits(record.metadata),
                reuse=reuse_of(record.metadata),
            )
            log.info("batch %s: submitting %s as job %s", batch_id, path, batch_id)

    def _submitted(self, record: BatchRecord) -> bool:
        """Whether every line of the batch is in its job (the submission ended well)."""
        if record.submitted:
            return True
        batch_id = record.id
        future = self._submitting.get(batch_id)
        if future is None:
            self._submit(record)
            return False
        if not future.done():
            return False
        del self._submitting[batch_id]
        try:
            future.result()
        except FabricError as exc:  # the broker is restarting: resumed on the next pass
            log.warning("batch %s: submission stopped (%s); resuming it", batch_id, exc)
            return False
        record.submitted = True
        self.batches.put(record)
        log.info("batch %s: every line is in job %s", batch_id, batch_id)
        return True

    def _fail(self, record: BatchRecord, errors: list[dict[str, Any]], now: float) -> None:
        record.errors = errors
        self._end(record, S.FAILED, now)

    # ---- running and finishing -------------------------------------------------------------
    def _cancel_job(self, batch_id: str, at_deadline: bool = False) -> None:
        """Cancel the batch's job; `at_deadline`: at its expires_at (the job ends `expired`)."""
        try:
            self.results.cancel(batch_id, at_deadline)
        except FabricError as exc:
            if "already" not in str(exc):  # a job that ended meanwhile: nothing to cancel
                raise

    def _control(self, batch_id: str, paused: bool) -> None:
        """Pause or resume the batch's job (api/control_routes.py took the request)."""
        try:
            self.results.control(batch_id, paused=paused)
            log.info("batch %s: job %s", batch_id, "paused" if paused else "resumed")
        except FabricError as exc:
            if "already" not in str(exc):  # a job that ended meanwhile: nothing to pause
                raise

    def _follow(self, record: BatchRecord, now: float) -> None:
        """Fetch new results; once the job ended and everything is here, finish the batch."""
        batch_id = record.id
        submitted = self._submitted(record)
        try:
            info = self.results.job_status(batch_id)
        except FabricError:
            if submitted:
                raise
            return  # no chunk of the job committed yet
        finished = is_terminal(info["state"]) and not info["undelivered"]
        paused = self.batches.pause_requested(batch_id)
        if bool(info.get("paused")) != paused and not is_terminal(info["state"]):
            self._control(batch_id, paused)  # a pause or resume asked for over HTTP
        due = _due(now, self._fetched.get(batch_id), FETCH_EVERY_S)
        if info["undelivered"] and (due or is_terminal(info["state"])):
            self._fetch(batch_id, now)
            info = self.results.job_status(batch_id)
            finished = is_terminal(info["state"]) and not info["undelivered"]
        finished = finished and submitted
        counts, usage = _counts(info, record), info.get("usage")
        metadata = with_reused(record.metadata, info)  # `fabric_reused` (api/batch_reuse.py)
        if counts != record.request_counts or usage != record.usage or metadata != record.metadata:
            record.request_counts, record.usage, record.metadata = counts, usage, metadata
            if not finished:
                self.batches.put(record)
        if record.error_file_id is None and self.out.has_errors(batch_id):
            self.out.register_errors(record)
            self.batches.put(record)
        if not finished:
            return
        if record.status != S.FINALIZING:
            record.move_to(S.FINALIZING, int(now))
            record.ended_as = JobState(info["state"])
            record.errors = stopped_errors(info) or record.errors  # a job a limit stopped
            self.batches.put(record)
        self._finalize(record, now)

    def _fetch(self, batch_id: str, now: float) -> None:
        self._fetched[batch_id] = now
        self.results.fetch(
            batch_id,
            str(self.batches.path(batch_id, OUTPUT)),
            str(self.batches.path(batch_id, ERRORS)),
            decoders=self.decoders,
        )

    def _finalize(self, record: BatchRecord, now: float) -> None:
        """Files complete and registered, then the end status, the job's (`ended_as`): safe to
        run again after a kill."""
        assert record.ended_as is not None
        self.out.register(record, "output")
        self.out.register_errors(record)
        self._end(record, openai_status(record.ended_as), now)
        self._fetched.pop(record.id, None)

    def _end(self, record: BatchRecord, status: BatchStatus, now: float) -> None:
        record.move_to(status, int(now))
        self.batches.put(record)
        if self.events is not None:
            self.events.ended(record, now)
        log.info("batch %s: %s", record.id, status)


def _counts(info: dict[str, Any], record: BatchRecord) -> dict[str, int]:
    """request_counts from the job's counters (with lines the driver kept out of the job)."""
    local = record.local_errors
    total = info["total"] if info["total"] is not None else record.request_counts["total"]
    return {
        "total": int(total) + (local if info["total"] is not None else 0),
        "completed": int(info["completed"]),
        "failed": int(info["failed"]) + local,
    }
