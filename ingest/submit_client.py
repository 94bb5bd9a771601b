"""The submit client (the producer SDK): hand a job to the broker and return once all of it
is durable.

    with Producer("tcp://127.0.0.1:7710") as producer:
        report = producer.submit_file("requests.jsonl")          # OpenAI Batch JSONL
        report = producer.submit_tokens("emb-1", "minilm", rows)   # numpy token arrays

A job is sent in numbered chunks of `chunk_lines` lines, a few at a time
(`window`). Each chunk is acknowledged only when every item of it is
durable in the broker's log, so when `submit_*` returns, the producer may
exit. A chunk that fails retryably (a full disk, a busy broker) is sent
again after a backoff of 0.2 s doubling to 5 s (`on_retry` hears of each;
pipeline/transport/broker_client.py `backoff_s`), one that gets no answer in
`timeout_s` at once, and every one still unanswered when the connection was
lost as soon as it is back (a restarted broker or front: pipeline/transport/reconnect_watch.py);
the broker stores nothing twice. Small requests (the
catalog, a job's status) go through the one request loop of every client
(pipeline/transport/broker_client.py). If the broker stays silent,
BrokerUnavailableError (pipeline/core/errors.py) says how far the job got; running the same submit
again with the same job id resumes after the chunks already acknowledged.

Lines are parsed and checked here, with the broker's own catalog of models
(so the broker's CPU goes to tokenising and writing); the broker checks
every chunk again before it stores anything.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from config import load_settings
from ingest.batch_input import iter_batch_input
from ingest.chunk_size import lines_per_chunk
from ingest.chunk_wire import chunk_to_wire
from ingest.error_wire import errors_from_wire
from ingest.input_chunk import InputChunk
from ingest.request_shape import Shape
from ingest.token_chunks import token_chunks
from pipeline.core.errors import BrokerUnavailableError, IngestError
from pipeline.store.job_record import DELIVER_FILE
from pipeline.transport import wire
from pipeline.transport.broker_client import BrokerClient, backoff_s
from pipeline.transport.reconnect_watch import ReconnectWatch
from pipeline.transport.security import ClientCurve

MT = wire.MessageType
QUICK_TRIES = 3  # requests that are not chunks: HELLO, JOB_STATUS
QUICK_WAIT_S = 5.0


class ChunkRefusedError(IngestError):
    """The broker refused a chunk for good (not retryable); the message says why."""


@dataclass
class SubmitReport:
    job_id: str
    chunks: int = 0
    stored: int = 0
    rejected: int = 0
    skipped_chunks: int = 0  # acknowledged in an earlier run
    stored_before: int = 0  # items stored by an earlier run of the same job (in `stored`)
    rejected_before: int = 0  # lines rejected by an earlier run (in `rejected`)
    errors: list[dict[str, Any]] = field(default_factory=list)
    state: str = ""


def new_job_id() -> str:
    """A job id for a submit that was given none: `job-` and 12 random hex digits."""
    return f"job-{uuid.uuid4().hex[:12]}"


Progress = Callable[[SubmitReport, int], None]  # (report so far, lines done)
# (job id, chunk, tries so far, the broker's reason, seconds until it is sent again)
RetryHook = Callable[[str, int, int, str, float], None]


class Producer(BrokerClient):
    """A connection to the ingest front; one thread at a time."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 30.0,
        window: int = 4,
        attempts: int = 10,
        curve: ClientCurve | None = None,
        patient: bool = False,
        on_waiting: Callable[[str], None] | None = None,
    ) -> None:
        """`timeout_s`: how long a chunk waits for its answer before it is sent again;
        `attempts`: tries of one chunk. `curve`: this producer's CURVE keys, for a broker that
        requires them. `patient`: wait for a broker that is not listening yet (one just
        started) instead of failing fast; `on_waiting` hears once "waiting for the broker at
        ADDR" (pipeline/transport/first_contact.py)."""
        self._watch: ReconnectWatch | None = None  # made with each socket (`_connect`)
        super().__init__(
            address,
            timeout_s,
            attempts,
            curve,
            patient,
            on_waiting,
            send_timeout_ms=int(timeout_s * 1000),
            send_hwm=window * 2,
        )
        self.window = window
        self._catalog: dict[str, Any] | None = None
        self._backing_off: dict[int, tuple[float, str]] = {}  # chunk -> (resend at, why)
        self.on_retry: RetryHook | None = None  # told of each retryable failure (a full disk)

    def _connect(self) -> None:
        if self._watch is not None:
            self._watch.close()
        super()._connect()
        self._watch = ReconnectWatch(self.socket)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        super().close()

    # ---- small requests --------------------------------------------------------------------
    def _request(self, msg_type: MT, meta: dict[str, Any], answer: MT) -> dict[str, Any]:
        """A small request: a few quick tries, so a broker that is down is reported fast."""
        wait_s = min(self.timeout_s, QUICK_WAIT_S)
        if self.patient and not self.contact.answered:  # a broker still starting: timeout_s
            wait_s = self.timeout_s
        return self.request(msg_type, meta, answer, attempts=QUICK_TRIES, wait_s=wait_s).meta

    def catalog(self) -> dict[str, Any]:
        """The broker's models, lanes and limits."""
        if self._catalog is None:
            self._catalog = self._request(MT.HELLO, {}, MT.CATALOG)
        return self._catalog

    def job_status(self, job_id: str) -> dict[str, Any]:
        return self._request(MT.JOB_STATUS, {"job": job_id}, MT.JOB_INFO)

    def settings(self, chunk_lines: int):
        """Settings matching the broker's catalog, for checking lines here."""
        catalog = self.catalog()
        return load_settings(
            None,
            {
                "broker": {"lanes": catalog["lanes"]},
                "ingest": {
                    "chunk_items": chunk_lines,
                    "max_message_bytes": catalog["max_message_bytes"],
                },
                "models": [
                    {k: m[k] for k in ("name", "engine", "tokenizer", "max_tokens", "endpoints")}
                    | {"vocab_size": int(m.get("vocab_size", 0))}  # 0 from a broker before it
                    | {"aliases": list(m.get("aliases", ()))}
                    for m in catalog["models"]
                ],
            },
        )

    # ---- submitting ------------------------------------------------------------------------
    def submit_file(
        self,
        source: str | Path,
        job_id: str | None = None,
        *,
        chunk_lines: int | None = None,
        parsed: tuple[int, Sequence[InputChunk]] | None = None,
        strict: bool = False,
        progress: Progress | None = None,
        deliver: str = DELIVER_FILE,
        deadline: float | None = None,
        job_priority: int = 0,
        notify: str = "",
        limits: dict[str, Any] | None = None,
        reuse: bool = False,
    ) -> SubmitReport:
        """Send every line of an OpenAI Batch JSONL file; return when all of it is durable.
        `parsed`: (chunk_lines, the chunks of `iter_batch_input(source, ..., chunk_lines)`) from
        a caller that checked the whole file first (api/batch_driver.py): sent as they are when
        the job takes chunks of that size, instead of parsing the file a second time.

        With `strict`, the whole file is checked first and nothing is sent if a
        line is bad (InputLineError names it). `deadline` (wall seconds since the epoch;
        `parse_deadline`) is recorded with a new job: dispatch serves earlier deadlines
        first. `job_priority` (an integer, higher first) likewise. A resumed job keeps the
        deadline and priority it was created with. `notify`: a URL the broker POSTs the job's
        end to (collector/completion/job_webhooks.py), likewise kept. `limits`: the job's
        caps (pipeline/core/job_limits.py `JobLimits.to_record`), recorded with a new job
        likewise. `reuse`: the job's lines take the stored results of identical earlier
        requests (docs/completion.md, "Result reuse"), likewise.
        """
        job_id = job_id or new_job_id()
        status = self.job_status(job_id)
        lines = (
            int(status["chunk_lines"])
            if status["exists"]
            else int(chunk_lines or lines_per_chunk(source, int(self.catalog()["chunk_items"])))
        )
        settings = self.settings(lines)
        if strict:
            for _ in iter_batch_input(source, settings, chunk_lines=lines, strict=True):
                pass
        if parsed is not None and parsed[0] == lines:
            chunks: Iterable[InputChunk] = parsed[1]
        else:
            chunks = iter_batch_input(source, settings, chunk_lines=lines)
        source = str(Path(source).resolve())  # recorded with the job (`vectors search` text)
        with _resume_hint(job_id):
            return self._send_chunks(
                job_id,
                lines,
                chunks,
                status,
                progress,
                deliver,
                source,
                deadline,
                job_priority,
                notify,
                limits,
                reuse,
            )

    def submit_tokens(
        self,
        job_id: str,
        model: str,
        rows: Sequence[np.ndarray] | np.ndarray,
        *,
        lengths: np.ndarray | None = None,
        custom_ids: Sequence[str] | None = None,
        endpoint: str = "/v1/embeddings",
        max_tokens: int | None = None,
        priority: int = 0,
        chunk_lines: int | None = None,
        progress: Progress | None = None,
        deliver: str = DELIVER_FILE,
        deadline: float | None = None,
    ) -> SubmitReport:
        """Send pre-tokenised items without JSON: `rows` is a list of uint32 arrays, or a 2-D
        array (with `lengths` when rows are padded). Item i gets line number i + 1 and
        custom_id `custom_ids[i]` (default `item-<i>`); `deadline` as for `submit_file`."""
        status = self.job_status(job_id)
        lines = (
            int(status["chunk_lines"])
            if status["exists"]
            else int(chunk_lines or self.catalog()["chunk_items"])
        )
        generate = endpoint != "/v1/embeddings"
        shape = Shape(
            endpoint=endpoint,
            max_tokens=(max_tokens or 256) if generate else None,
            temperature=1.0 if generate else None,
            top_p=1.0 if generate else None,
            seed=None,
            stop=(),
            priority=priority,
        )
        chunks = token_chunks(rows, lengths, custom_ids, model, shape, lines)
        with _resume_hint(job_id):
            return self._send_chunks(
                job_id, lines, chunks, status, progress, deliver, deadline=deadline
            )

    def _send_chunks(
        self,
        job_id: str,
        chunk_lines: int,
        chunks: Iterable[InputChunk],
        status: dict[str, Any],
        progress: Progress | None,
        deliver: str = DELIVER_FILE,
        source: str = "",
        deadline: float | None = None,
        job_priority: int = 0,
        notify: str = "",
        limits: dict[str, Any] | None = None,
        reuse: bool = False,
    ) -> SubmitReport:
        report = SubmitReport(job_id)
        self._backing_off.clear()
        done = set(status.get("committed", [])) if status["exists"] else set()
        if status["exists"]:
            report.stored = report.stored_before = int(status.get("stored", 0))
            report.rejected = report.rejected_before = int(status.get("rejected", 0))
        pending: dict[int, tuple[dict[str, Any], dict[str, np.ndarray], float, int]] = {}
        stream = _with_last(iter(chunks))
        exhausted = False
        lines_done = 0
        while not exhausted or pending:
            while not exhausted and len(pending) < self.window:
                item = next(stream, None)
                if item is None:
                    exhausted = True
                    break
                chunk, last = item
                lines_done = chunk.last_line
                if chunk.index in done and not last:
                    report.skipped_chunks += 1
                    continue
                meta, arrays = chunk_to_wire(chunk)
                meta.update(
                    job=job_id,
                    chunk=chunk.index,
                    chunk_lines=chunk_lines,
                    final=last,
                    deliver=deliver,
                )
                if source:
                    meta["source"] = source
                if deadline is not None:
                    meta["deadline"] = float(deadline)
                if job_priority:
                    meta["job_priority"] = int(job_priority)
                if notify:
                    meta["notify"] = notify
                if limits:
                    meta["limits"] = limits
                if reuse:
                    meta["reuse"] = True
                self.send(MT.SUBMIT_CHUNK, meta, arrays)
                pending[chunk.index] = (meta, arrays, time.monotonic(), 1)
            if pending:
                self._await_one(job_id, pending, report)
                if progress is not None:
                    progress(report, lines_done)
        return report

    def _await_one(self, job_id: str, pending: dict, report: SubmitReport) -> None:
        """Wait for one answer; resend chunks that failed retryably or went unanswered.

        A chunk that failed retryably waits out its backoff in `_backing_off`
        while the answers to the others keep coming. One unanswered when the
        connection was lost is sent again as soon as it is back.
        """
        now = time.monotonic()
        for number, (due, why) in list(self._backing_off.items()):
            if now >= due:
                del self._backing_off[number]
                meta, arrays, _, tries = pending[number]
                self._retry(job_id, pending, number, meta, arrays, tries, why)
        deadlines = [due for due, _ in self._backing_off.values()] + [
            sent + self.timeout_s
            for number, (_, _, sent, _) in pending.items()
            if number not in self._backing_off
        ]
        wait_s = max(0.0, min(deadlines) - time.monotonic())
        self._watch.wait(int(wait_s * 1000) + 1)
        lost_at = self._watch.back()
        message = wire.recv(self.socket, 0)
        now = time.monotonic()
        if lost_at is not None:  # every chunk it was carrying then is gone with the old peer
            for number, (meta, arrays, sent, tries) in list(pending.items()):
                if number not in self._backing_off and sent <= lost_at:
                    why = "the connection to the broker was lost"
                    self._retry(job_id, pending, number, meta, arrays, tries, why)
        if message is None:
            for number, (meta, arrays, sent, tries) in list(pending.items()):
                if number not in self._backing_off and now - sent >= self.timeout_s:
                    self._retry(job_id, pending, number, meta, arrays, tries, "no answer")
            return
        meta = message.meta
        number = meta.get("chunk")
        if meta.get("job") != job_id or number not in pending:
            return  # an answer to an earlier try, already handled
        if message.type == MT.CHUNK_ACK:
            del pending[number]
            self._backing_off.pop(number, None)
            report.chunks += 1
            errors = [e.to_batch_error(job_id) for e in errors_from_wire(message.arrays)]
            errors += meta.get("errors", [])  # a broker from before the arrays
            if not meta.get("duplicate"):
                report.stored += int(meta["stored"])
                report.rejected += len(errors)
            report.errors.extend(errors)
            report.state = str(meta.get("state", ""))
        elif message.type == MT.CHUNK_ERROR and message.retryable:
            if number in self._backing_off:
                return  # an answer to an earlier try of a chunk already waiting
            tries, reason = pending[number][3], str(meta["reason"])
            if tries >= self.attempts:
                raise BrokerUnavailableError(
                    f"chunk {number} of job {job_id} failed {tries} times (last: {reason})"
                )
            delay_s = backoff_s(tries, jitter=False)
            self._backing_off[number] = (now + delay_s, reason)
            if self.on_retry is not None:
                self.on_retry(job_id, number, tries, reason, delay_s)
        elif message.type in (MT.CHUNK_ERROR, MT.ERROR):
            raise ChunkRefusedError(
                f"the broker refused chunk {number} of job {job_id}: {meta.get('reason')}"
            )

    def _retry(self, job_id, pending, number, meta, arrays, tries, why: str) -> None:
        if tries >= self.attempts:
            raise BrokerUnavailableError(
                f"chunk {number} of job {job_id} failed {tries} times (last: {why})"
            )
        self.send(MT.SUBMIT_CHUNK, meta, arrays)
        pending[number] = (meta, arrays, time.monotonic(), tries + 1)


@contextmanager
def _resume_hint(job_id: str) -> Iterator[None]:
    """Add to BrokerUnavailableError what the user can do about it."""
    try:
        yield
    except BrokerUnavailableError as exc:
        raise BrokerUnavailableError(
            f"{exc}; the chunks acknowledged so far are durable: run the same submit again "
            f"with --job-id {job_id} to resume"
        ) from exc


def _with_last(chunks: Iterator[InputChunk]) -> Iterator[tuple[InputChunk, bool]]:
    """Each chunk with a flag saying whether it is the last one."""
    previous = next(chunks, None)
    for chunk in chunks:
        yield previous, False
        previous = chunk
    if previous is not None:
        yield previous, True
