"""Moves each batch through OpenAI's states over the broker's own ingest and completion paths.

    validating --(lines checked, job submitted)--> in_progress --(job done, results
    fetched)--> finalizing --> completed
    validating --(bad lines, OpenAI's default)--> failed
    in_progress --(cancel)--> cancelling --> cancelled     (results made so far are kept)
    in_progress --(expires_at)--> expired                  (unfinished items: batch_expired lines)

A batch ends in its job's end state (pipeline/job_states.py `OPENAI_STATUS`), so
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
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from api.batch_store import (
    ACCEPT_PARTIAL_KEY,
    ERRORS,
    INPUT_COPY,
    OUTPUT,
    STATUSES,
    TERMINAL,
    BatchStore,
)
from api.batch_validation import Checked, check_and_send, error
from api.file_store import PURPOSE_OUTPUT, FileRecord, FileStore, output_file_id
from collector.delivery.decoders import Decoder
from collector.delivery.lines import line_key
from collector.delivery.result_file import ResultFile
from collector.results_client import ResultsClient
from ingest.submit_client import Producer
from pipeline.durable import write_whole
from pipeline.errors import FabricError
from pipeline.job_states import JobState, is_terminal, openai_status

log = logging.getLogger("fabric.api")
EXPIRED_CODE = "batch_expired"
CANCELLED_CODE = "cancelled"  # the code completion gives a cancelled item's error line
FETCH_EVERY_S = 1.0  # a running batch's results are fetched this often (and when it ends)
CANCEL_WAIT_S = 5.0  # a job not known this long after its validation stopped is sent its lines


class BatchDriver:
    """Advances every unfinished batch one step per `step()`; each step is idempotent."""

    def __init__(
        self,
        files: FileStore,
        batches: BatchStore,
        producers: tuple[Producer, Producer],
        results: ResultsClient,
        decoders: dict[str, Decoder] | None = None,
    ) -> None:
        """`producers`: one for the broker's catalog on this thread, one for submissions on
        the submit thread (a ZeroMQ socket is used by one thread only); `decoders`: the
        models' (collector/delivery/decoders.py), for the text of generated results."""
        self.files = files
        self.batches = batches
        self.catalog, self.producer = producers
        self.results = results
        self.decoders = decoders or {}
        self._fetched: dict[str, float] = {}  # batch id -> last fetch (monotonic)
        self._done: set[str] = set()  # batches seen ended: not read again
        self._ended: dict[str, int] = {}  # of those, how many in each end state
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

    def step(self) -> dict[str, int]:
        """One pass over the unfinished batches; returns how many batches are in each status."""
        counts = dict.fromkeys(STATUSES, 0)
        for record in self.batches.all(skip=self._done):
            if record["status"] in TERMINAL:
                self._done.add(record["id"])
                self._ended[record["status"]] = self._ended.get(record["status"], 0) + 1
                continue
            try:
                self.advance(record)
            except FabricError as exc:  # the broker is restarting: the next pass tries again
                log.warning("batch %s: %s; trying again", record["id"], exc)
            status = record["status"]
            counts[status] = counts.get(status, 0) + 1
        for status, n in self._ended.items():
            counts[status] += n
        return counts

    def advance(self, record: dict[str, Any]) -> None:
        now = int(time.time())
        batch_id = record["id"]
        cancel_at = self.batches.cancel_requested(batch_id)
        status = record["status"]
        if status == "validating":
            expired = record["expires_at"] is not None and now >= record["expires_at"]
            if record.get("ending") is not None:
                self._close_job_then_end(record, now)
            elif cancel_at is not None or expired:
                self._stop_validating(record, "cancelled" if cancel_at is not None else "expired")
            else:
                self._validate_and_submit(record)
            return
        if status == "in_progress" and cancel_at is not None:
            self._cancel_job(batch_id)
            record.update(status="cancelling", cancelling_at=cancel_at)
            self.batches.put(record)
        expired = record["expires_at"] is not None and now >= record["expires_at"]
        if status in ("in_progress", "cancelling") and expired and not record.get("expiring"):
            self._cancel_job(batch_id, at_deadline=True)
            record["expiring"] = True
            self.batches.put(record)
        self._follow(record, now)

    # ---- validating ------------------------------------------------------------------------
    def _validate_and_submit(self, record: dict[str, Any]) -> None:
        """Start checking the batch's lines, sending them as its job as they check out (on the
        submit thread); once that pass ended, the batch is in_progress or failed."""
        batch_id = record["id"]
        running = self._validating.get(batch_id)
        if running is None:
            source = self.files.get(record["input_file_id"])
            if source is None:
                self._fail(record, [error("file_not_found", None, "the input file was deleted")])
                return
            stop = threading.Event()
            path = self.files.content_path(source)
            future = self._submitter.submit(
                check_and_send,
                self.producer,
                path,
                batch_id,
                record["endpoint"],
                accept_partial=_accepts_partial(record),
                deadline=record["expires_at"],
                stop=stop,
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
        self._validated(record, checked, path)

    def _validated(self, record: dict[str, Any], checked: Checked, path: Path) -> None:
        batch_id = record["id"]
        errors, wrong_url = checked.errors, checked.wrong_url
        if errors and not _accepts_partial(record):
            self._end_validating(record, {"status": "failed", "errors": errors}, path, checked.job)
            return
        source_path = str(path)
        if wrong_url:  # kept out of the job: their error lines are written here, blank lines sent
            source_path = str(self._without_lines(record, path, wrong_url, errors))
        record.update(
            status="in_progress",
            in_progress_at=int(time.time()),
            output_file_id=output_file_id(batch_id, "output"),
            local_errors=len(wrong_url),
            submit_path=source_path,
            submitted=checked.sent_all,
            request_counts={"total": checked.lines, "completed": 0, "failed": len(errors)},
        )
        self._register(record, "output", OUTPUT)
        self.batches.put(record)
        if not checked.sent_all:  # the rest of the lines, from the copy without wrong urls
            self._submit(record)

    def _stop_validating(self, record: dict[str, Any], status: str) -> None:
        """A batch cancelled or expired while validating: its pass is stopped (the next passes
        look again until it has), then the batch ends as `status`."""
        batch_id = record["id"]
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
            source = self.files.get(record["input_file_id"])
            path = self.files.content_path(source) if source is not None else None
        self._end_validating(record, {"status": status}, path, job)

    def _end_validating(
        self, record: dict[str, Any], ending: dict[str, Any], path: Path | None, job: bool
    ) -> None:
        """End a batch before in_progress (`ending`: its status, and errors for `failed`);
        `job`: some of its lines may be in its job, which is closed first."""
        if job and path is not None:
            record.update(ending=ending, submit_path=str(path), submitted=False)
            self.batches.put(record)
            self._close_job_then_end(record, int(time.time()))
            return
        now = int(time.time())
        if ending["status"] == "failed":
            self._fail(record, ending["errors"])
        elif ending["status"] == "cancelled":
            cancel_at = self.batches.cancel_requested(record["id"])
            self._end(record, "cancelled", now, cancelling_at=cancel_at)
        else:
            self._expire_unsubmitted(record, now)

    def _close_job_then_end(self, record: dict[str, Any], now: int) -> None:
        """A batch ending while validating, with lines in its job: the job is cancelled, then
        sent the rest of the file, so that it finishes (`cancelled`: the rest is not run) and
        its results expire like any job's, where a job never sent its last chunk would stay
        `validating` for ever; then the batch ends. Each step is safe to repeat."""
        batch_id = record["id"]
        if not record.get("job_cancelled"):
            try:
                self._cancel_job(batch_id, at_deadline=record["ending"]["status"] == "expired")
            except FabricError as exc:  # no chunk of it committed yet: the next pass
                first = self._uncancelled.setdefault(batch_id, time.monotonic())
                log.info("batch %s: its job cannot be cancelled yet (%s)", batch_id, exc)
                if time.monotonic() - first >= CANCEL_WAIT_S:  # none is coming: make the job
                    self._submitted(record)
                return
            self._uncancelled.pop(batch_id, None)
            record["job_cancelled"] = True
            self.batches.put(record)
        if self._submitted(record):
            self._end_validating(record, record.pop("ending"), None, False)

    def _submit(self, record: dict[str, Any]) -> None:
        """Start (or, after a restart, resume) sending the input as the batch's job."""
        batch_id = record["id"]
        if batch_id not in self._submitting:
            path = record["submit_path"]
            self._submitting[batch_id] = self._submitter.submit(
                self.producer.submit_file, path, batch_id, deadline=record["expires_at"]
            )
            log.info("batch %s: submitting %s as job %s", batch_id, path, batch_id)

    def _submitted(self, record: dict[str, Any]) -> bool:
        """Whether every line of the batch is in its job (the submission ended well)."""
        if record.get("submitted", True):
            return True
        batch_id = record["id"]
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
        record["submitted"] = True
        self.batches.put(record)
        log.info("batch %s: every line is in job %s", batch_id, batch_id)
        return True

    def _without_lines(
        self, record: dict[str, Any], path: Path, drop: dict[int, str | None], errors: list
    ) -> Path:
        """A copy of the input with lines `drop` blank (numbers kept); their error lines are
        written to the batch's error file first."""
        batch_id = record["id"]
        messages = {e["line"]: e["message"] for e in errors}
        with ResultFile.open(self.batches.path(batch_id, ERRORS)) as err:
            lines, keys = [], []
            for number, custom_id in drop.items():
                line = _error_line(batch_id, number, custom_id, "invalid_url", messages[number])
                lines.append(line)
                keys.append(line_key(custom_id, f"{batch_id}-line-{number}"))
            err.write(lines, keys)
            err.sync()
        copy = self.batches.path(batch_id, INPUT_COPY)
        with open(path, "rb") as src, open(copy, "wb") as dst:
            for number, line in enumerate(src, 1):
                dst.write(b"\n" if number in drop else line)
            dst.flush()
        return copy

    def _fail(self, record: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        record["errors"] = errors
        self._end(record, "failed", int(time.time()))

    def _expire_unsubmitted(self, record: dict[str, Any], now: int) -> None:
        """The deadline passed before the job was submitted: every line is batch_expired."""
        source = self.files.get(record["input_file_id"])
        if source is not None:
            with ResultFile.open(self.batches.path(record["id"], ERRORS)) as err:
                lines, keys = [], []
                for number, custom_id in _custom_ids(self.files.content_path(source)):
                    message = "the batch expired before this request was run"
                    lines.append(
                        _error_line(record["id"], number, custom_id, EXPIRED_CODE, message)
                    )
                    keys.append(line_key(custom_id, f"{record['id']}-line-{number}"))
                err.write(lines, keys)
                err.sync()
            record["request_counts"] = {"total": len(lines), "completed": 0, "failed": len(lines)}
        self._register_errors(record)
        self._end(record, "expired", now)

    # ---- running and finishing -------------------------------------------------------------
    def _cancel_job(self, batch_id: str, at_deadline: bool = False) -> None:
        """Cancel the batch's job; `at_deadline`: at its expires_at (the job ends `expired`)."""
        try:
            self.results.cancel(batch_id, at_deadline)
        except FabricError as exc:
            if "already" not in str(exc):  # a job that ended meanwhile: nothing to cancel
                raise

    def _follow(self, record: dict[str, Any], now: int) -> None:
        """Fetch new results; once the job ended and everything is here, finish the batch."""
        batch_id = record["id"]
        submitted = self._submitted(record)
        try:
            info = self.results.job_status(batch_id)
        except FabricError:
            if submitted:
                raise
            return  # no chunk of the job committed yet
        finished = is_terminal(info["state"]) and not info["undelivered"]
        due = time.monotonic() - self._fetched.get(batch_id, 0.0) >= FETCH_EVERY_S
        if info["undelivered"] and (due or is_terminal(info["state"])):
            self._fetch(batch_id)
            info = self.results.job_status(batch_id)
            finished = is_terminal(info["state"]) and not info["undelivered"]
        finished = finished and submitted
        counts, usage = _counts(info, record), info.get("usage")
        if counts != record["request_counts"] or usage != record.get("usage"):
            record.update(request_counts=counts, usage=usage)
            if not finished:
                self.batches.put(record)
        if record.get("error_file_id") is None and self._has_errors(batch_id):
            self._register_errors(record)
            self.batches.put(record)
        if not finished:
            return
        if record["status"] != "finalizing":
            record.update(status="finalizing", finalizing_at=now, ended_as=info["state"])
            self.batches.put(record)
        self._finalize(record)

    def _fetch(self, batch_id: str) -> None:
        self._fetched[batch_id] = time.monotonic()
        self.results.fetch(
            batch_id,
            str(self.batches.path(batch_id, OUTPUT)),
            str(self.batches.path(batch_id, ERRORS)),
            decoders=self.decoders,
        )

    def _finalize(self, record: dict[str, Any]) -> None:
        """Files complete and registered, then the end state, the job's (`ended_as`): safe to
        run again after a kill."""
        batch_id = record["id"]
        end = openai_status(record["ended_as"])
        if record["ended_as"] == JobState.EXPIRED:  # its cancelled items' lines say why
            _rewrite_codes(self.batches.path(batch_id, ERRORS), CANCELLED_CODE, EXPIRED_CODE)
        self._register(record, "output", OUTPUT)
        self._register_errors(record)
        self._end(record, end, int(time.time()))
        self._fetched.pop(batch_id, None)

    def _end(self, record: dict[str, Any], status: str, now: int, **stamps: Any) -> None:
        record.update(stamps)
        record["status"] = status
        record[f"{status}_at"] = now
        self.batches.put(record)
        log.info("batch %s: %s", record["id"], status)

    # ---- output and error files ------------------------------------------------------------
    def _has_errors(self, batch_id: str) -> bool:
        path = self.batches.path(batch_id, ERRORS)
        return path.exists() and path.stat().st_size > 0

    def _register_errors(self, record: dict[str, Any]) -> None:
        if self._has_errors(record["id"]):
            record["error_file_id"] = output_file_id(record["id"], "error")
            self._register(record, "error", ERRORS)

    def _register(self, record: dict[str, Any], which: str, name: str) -> None:
        """Write the File record of the batch's output or error file (again: it is the same)."""
        batch_id = record["id"]
        path = self.batches.path(batch_id, name)
        if not path.exists():
            ResultFile.open(path).close()  # created empty, and its directory synced
        self.files.put(
            FileRecord(
                id=output_file_id(batch_id, which),
                owner=record["owner"],
                bytes=path.stat().st_size,
                created_at=record.get("in_progress_at") or record["created_at"],
                filename=f"{batch_id}_{which}.jsonl",
                purpose=PURPOSE_OUTPUT,
                path=str(path.relative_to(self.files.root)),
                batch_id=batch_id,
            )
        )


def _counts(info: dict[str, Any], record: dict[str, Any]) -> dict[str, int]:
    """request_counts from the job's counters (with lines the driver kept out of the job)."""
    local = int(record.get("local_errors") or 0)
    total = info["total"] if info["total"] is not None else record["request_counts"]["total"]
    return {
        "total": int(total) + (local if info["total"] is not None else 0),
        "completed": int(info["completed"]),
        "failed": int(info["failed"]) + local,
    }


def _error_line(batch_id: str, number: int, custom_id, code: str, message: str) -> bytes:
    line = {
        "id": f"{batch_id}-line-{number}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _accepts_partial(record: dict[str, Any]) -> bool:
    """Whether the batch's metadata chose to run its good lines despite bad ones."""
    value = str((record.get("metadata") or {}).get(ACCEPT_PARTIAL_KEY, ""))
    return value.lower() in ("true", "1", "yes")


def _custom_ids(path: Path):
    """(line number, custom_id or None) of every non-blank line."""
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    custom_id = orjson.loads(line).get("custom_id")
                except (orjson.JSONDecodeError, AttributeError):
                    custom_id = None
                yield number, custom_id if isinstance(custom_id, str) else None


def _rewrite_codes(path: Path, old: str, new: str) -> None:
    """Error lines with code `old` get code `new` (an expired batch's cancelled items), in
    place of the file, atomically; a file already rewritten is left as it is."""
    if not path.exists():
        return
    data = path.read_bytes()
    marker = orjson.dumps({"code": old})[1:-1]
    if marker not in data:
        return
    out = []
    for line in data.splitlines(keepends=True):
        if marker in line:
            record = orjson.loads(line)
            if record.get("error", {}).get("code") == old:
                record["error"] = {
                    "code": new,
                    "message": "the batch expired before this request was run",
                }
                line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        out.append(line)
    write_whole(path, b"".join(out))
