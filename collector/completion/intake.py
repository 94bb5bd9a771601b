"""Result intake: what dispatch forwards (worker RESULTS, ITEM_ERRORS) checked and stored.

Each RESULTS message is checked as a whole (`results_problem`: the arrays of
docs/wire.md, in bounds), then per item against what its input item asked
for (collector/completion/result_check.py): a result refused for the
worker's fault is handed back to dispatch with the next RETIRED (`hand_back`),
one refused on its last attempt or for the model's fault is stored as the
item's error `invalid_result`. The rest is recorded in the completion log
without a sync (the stage's group commit follows). Every RESULTS message adds
an ack `[route, result_id, items]` for the next RETIRED, even when its items
turn out to be duplicates, refused or malformed; one that cannot be stored
(DiskFullError) takes its ack back, so the worker sends it again.

Rejected lines (the front's journal) become error results here too
(`rejected_lines`). Every job given results is noted in `touched`: the stage
finishes those that are done once their results are durable.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import numpy as np

from collector.completion.record_format import flags_of
from collector.completion.result_check import CAUSES, HAND_BACK, ResultCheck, expected_for
from collector.completion.results_log import CompletionLog, Results
from collector.completion.reuse import ResultReuse
from collector.completion.worker_time import WorkerTime, engine_seconds
from collector.job_view import JobIndex, JobView
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core.errors import DiskFullError
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.core.item_seq import index_of, job_of
from pipeline.core.ragged import Ragged, offsets_problem
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.intern_table import InternTable
from pipeline.store.segment import Segment
from pipeline.transport import wire

ERROR_TEXT = flags_of(ResultStatus.ERROR, ResultKind.TEXT)  # an error result's flags


def results_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """What is wrong with the arrays of a RESULTS message (docs/wire.md), or None.

    Every array is one-dimensional with one entry per item (offsets: n + 1 byte
    offsets into the u1 payload, by the offsets rule of pipeline/core/ragged.py), so
    nothing a worker sends can index outside what it sent.
    """
    names = ("items", "status", "kind", "prompt_tokens", "payload", "offsets")
    missing = [name for name in names if name not in arrays]
    if missing:
        return f"arrays {missing} missing"
    if any(arrays[name].ndim != 1 for name in names):
        return "an array is not one-dimensional"
    items, payload = arrays["items"], arrays["payload"]
    if items.dtype != ITEM_DTYPE:
        return f"items are {items.dtype.descr}, not {ITEM_DTYPE.descr}"
    n = len(items)
    for name in ("status", "kind", "prompt_tokens"):
        if arrays[name].dtype.kind not in "ui":
            return f"{name} is {arrays[name].dtype.str}, not integers"
        if len(arrays[name]) != n:
            return f"{name} has {len(arrays[name])} entries for {n} items"
    if payload.dtype != np.uint8:
        return f"payload is {payload.dtype.str}, not u1"
    return offsets_problem(arrays["offsets"], n, len(payload))


SENT_AGAIN = "sent again"  # a worker sent a result again (no ack reached it)
COMPUTED_AGAIN = "computed again"  # an item computed twice (reclaimed, then both answered)


class ResultIntake:
    """Checks and records what dispatch forwards; collects the acks and hand-backs of the
    next RETIRED. Owned by the completion stage (one thread)."""

    def __init__(
        self,
        completion_log: CompletionLog,
        jobs: JobIndex,
        shapes: InternTable,
        open_input: Callable[[int], Segment],
        max_attempts: int,
        log: logging.Logger,
    ) -> None:
        self.completion_log = completion_log
        self.jobs = jobs
        self.shapes = shapes
        self.open_input = open_input
        self.max_attempts = max_attempts
        self.log = log
        self.checker = ResultCheck()  # every worker result against its item (trust nothing)
        self.acks: list[list] = []  # [route, result_id, items] per RESULTS message
        self.hand_back: list[tuple[str, int, np.ndarray]] = []  # (session, batch, items)
        self.touched: set[str] = set()  # jobs given results since the stage last looked
        self.stored = 0  # results stored (metrics)
        # results dropped because their item had one, by why: a worker's resend ("sent
        # again") or a second computation after a reclaim ("computed again") (metrics)
        self.duplicates = {SENT_AGAIN: 0, COMPUTED_AGAIN: 0}
        self.refused: collections.Counter[str] = collections.Counter()  # cause -> results
        self.worker_time = WorkerTime(jobs.files, log)  # engine seconds per job (worker_time.py)
        self.reuse: ResultReuse | None = None  # the stage's (collector/completion/reuse.py)

    def results(self, message: wire.Message) -> None:
        """Store a worker's results; acknowledged at the next flush. DiskFullError: not
        acknowledged (what was stored of it is a duplicate when the worker sends it again)."""
        meta, a = message.meta, message.arrays
        ack = [meta.get("route", ""), meta["result_id"], 0]
        self.acks.append(ack)
        problem = results_problem(a)
        if problem is not None:
            self.log.error(
                "results from session %s are malformed (%s); dropped", meta["session"], problem
            )
            return
        items = a["items"]
        rows = Ragged(a["payload"], a["offsets"].astype(np.int64))
        ack[2] = len(items)
        expected, attempts = expected_for(items, self.open_input, self.shapes)
        verdict = self.checker.check(expected, a["status"], a["kind"], rows.values, rows.offsets)
        error = a["status"] == ResultStatus.ERROR  # the worker's own error: stored as text
        kind = np.where(error, ResultKind.TEXT, a["kind"].astype(np.uint32) & 0xF)
        status = flags_of(error, kind)
        prompt = a["prompt_tokens"].astype(np.uint32)
        good = np.flatnonzero(verdict.cause == 0)
        try:
            kept = rows.take(good) if len(good) < len(items) else rows
            why = SENT_AGAIN if meta.get("resent") else COMPUTED_AGAIN
            per_item = engine_seconds(meta) / len(items) if len(items) else 0.0
            known = self.record(items[good], status[good], kept, prompt[good], why, per_item)
            back = (
                self._refuse(meta["session"], items, verdict, attempts)
                if len(good) < len(items)
                else None
            )
            if not known:  # not acknowledged: the worker sends them again, the rest are duplicates
                self.acks.pop()
            elif back is not None and len(back):
                batch_id = meta.get("batch_id")  # a worker's word: used only to find its lease
                batch_id = batch_id if isinstance(batch_id, int) and batch_id >= 0 else 0
                self.hand_back.append((str(meta["session"]), batch_id, back))
        except DiskFullError:
            self.acks.pop()  # this message's ack, appended last: the worker sends them again
            raise

    def _refuse(self, session, items, verdict, attempts) -> np.ndarray:
        """Results that failed their check (collector/completion/result_check.py): stored as
        the item's error `invalid_result` (not finite, or refused on its last attempt), or
        returned to be handed back to dispatch with the next RETIRED (counting an attempt)."""
        last = attempts + 1 >= self.max_attempts
        back = []
        for cause in np.unique(verdict.cause[verdict.cause != 0]).tolist():
            mine = verdict.cause == cause
            self.refused[CAUSES[cause]] += int(mine.sum())
            errors = mine & (last | (cause not in HAND_BACK))
            if errors.any():
                self.errors(items[errors], verdict.reason(cause))
            back.append(items[mine & ~errors])
            self.log.warning(
                "session %s: %d result(s) refused (%s: %s): %d stored as errors, %d handed back",
                session,
                int(mine.sum()),
                CAUSES[cause],
                verdict.detail.get(cause, ""),
                int(errors.sum()),
                int((mine & ~errors).sum()),
            )
        return np.concatenate(back) if back else items[:0]

    def item_errors(self, message: wire.Message) -> None:
        """Dispatch's ITEM_ERRORS: one error result, its `reason`, for each of its items. The
        items of a job cancelled at its deadline get `batch_expired` instead of `cancelled`,
        those of a job stopped by a limit its stop's code (`error_cap`, `budget_exceeded`)
        (dispatch does not know why a job was cancelled; its cancel mark does), so every door
        writes the same code for them."""
        items = message.arrays["items"]
        reason = str(message.meta["reason"])
        if not reason.startswith(f"{ItemErrorCode.CANCELLED}:"):
            self.errors(items, reason)
            return
        job_nos = job_of(items["seq"])
        for job_no in np.unique(job_nos).tolist():
            pick = job_nos == job_no
            self.errors(items[pick], self._cancelled_reason(int(job_no), reason))

    def _cancelled_reason(self, job_no: int, reason: str) -> str:
        job_id = self.jobs.job_id(job_no)
        view = self.jobs.view(job_id) if job_id is not None else None
        if view is None:
            return reason
        if view.cancelled_at_deadline:
            return f"{ItemErrorCode.BATCH_EXPIRED}: the job's deadline passed before the item ran"
        stop = view.stopped
        if stop is not None:  # a limit stopped the job (collector/completion/caps.py)
            return f"{stop.code}: the job was stopped before the item ran: {stop.message}"
        return reason

    def errors(self, items: np.ndarray, text: str) -> None:
        """Store one error result, `text` ("code: message"), for each of `items`."""
        reason = text.encode("utf-8")
        n = len(items)
        rows = Ragged(np.frombuffer(reason * n, np.uint8), np.arange(n + 1) * len(reason))
        status = np.full(n, ERROR_TEXT, np.uint32)
        self.record(items, status, rows, np.zeros(n, np.uint32))

    def rejected_lines(self, view: JobView) -> None:
        """Store the job's lines the front rejected since the last call as error results
        (`code: message`), durable before this returns. DiskFullError: those not stored stay
        in the view for the next call (those stored are skipped as duplicates then)."""
        rejected = view.take_rejected()
        if not rejected:
            return
        index = np.array([int(r[0]) - 1 for r in rejected], np.int64)
        reasons = [f"{r[2]}: {r[3]}" for r in rejected]
        self.touched.add(view.job_id)
        try:
            self.completion_log.record_errors(view.job_id, view.job_no, index, reasons)
            self.completion_log.sync_outputs()
        except DiskFullError:
            view.rejected[:0] = rejected
            raise

    def record(
        self, items, status, rows: Ragged, prompt, why: str = COMPUTED_AGAIN, engine_s=0.0
    ) -> bool:
        """Store results; False if some name a job number this broker does not know (yet).
        `engine_s`: the worker-seconds of each item, added to its job for each one stored."""
        known = True
        job_nos = job_of(items["seq"])
        for job_no in np.unique(job_nos).tolist():
            pick = np.flatnonzero(job_nos == job_no)
            job_id = self.jobs.job_id(int(job_no))
            if job_id is None:
                self.log.error(
                    "%d result(s) for unknown job number %d not stored or acknowledged",
                    len(pick),
                    job_no,
                )
                known = False
                continue
            mine = rows if len(pick) == len(items) else rows.take(pick)
            self.touched.add(job_id)
            recorded = self.completion_log.record(
                Results(
                    job_id,
                    int(job_no),
                    items["segment"][pick],
                    items["slot"][pick],
                    items["seq"][pick],
                    status[pick],
                    mine.values,
                    mine.offsets,
                    prompt[pick],
                ),
                sync=False,
            )
            self.stored += recorded.stored
            self.worker_time.add(job_id, engine_s * recorded.stored)
            view = self.jobs.view(job_id) if self.reuse is not None else None
            if self.reuse is not None and view is not None and view.reuse:  # into the index
                index = index_of(items["seq"][pick]).astype(np.int64)
                self.reuse.note(view, index, status[pick], mine, prompt[pick])
            self.duplicates[why] = self.duplicates.get(why, 0) + recorded.duplicates
            if recorded.duplicates:
                self.log.info(
                    "job %s: %d duplicate result(s) dropped (%s)", job_id, recorded.duplicates, why
                )
            for line in recorded.refused[:5]:
                self.log.warning("job %s: result refused: %s", job_id, line)
        return known
