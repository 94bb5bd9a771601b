"""The results client: fetch a job's results exactly once, its status, cancel it; broker status.

`python run.py results JOB -o OUT.jsonl [--errors ERR.jsonl] [--follow] [--all]`
runs `ResultsClient.fetch`. Each page is written to OUT and ERR (lines a file
already holds are skipped, so a re-run after a crash writes each custom_id
once), both files are fsynced, and only then is the page acknowledged, with
a later request (invariant 12; the protocol: collector/delivery_client.py).
The request for the next page goes out before a page is written (asking
ahead, when completion offers it), so completion reads it while the client
formats and writes; a page's fsync runs on a thread (`Syncing`) while the
next page is written, and its ack goes with the first request after it. A broker that goes away is retried with
backoff (pipeline/transport/broker_client.py); with `follow` the client keeps going
until the job is finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic as now
from typing import Any

import numpy as np

from collector.delivery.lines import render_page
from collector.delivery.result_file import ResultFile
from collector.delivery.result_page import ExportContext, PageError, ResultPage
from collector.delivery_client import Delivery
from pipeline.core.errors import FabricError, WireError
from pipeline.core.job_states import JobState
from pipeline.core.ragged import Ragged
from pipeline.transport import wire
from pipeline.transport.broker_client import BrokerClient

MT = wire.MessageType


@dataclass
class FetchReport:
    written: int = 0  # output lines written in this run
    errors: int = 0  # error lines written in this run
    pages: int = 0
    info: dict[str, Any] | None = None


class Syncing:
    """A page's files fsynced on a thread, while the client writes the next page; `wait`
    returns the page once both are on disk (and raises what the fsync raised)."""

    def __init__(self, files: tuple[ResultFile, ...], page: int) -> None:
        self.page = page
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._sync, args=(files,), daemon=True)
        self.thread.start()

    def _sync(self, files: tuple[ResultFile, ...]) -> None:
        try:
            for file in files:
                file.sync()
        except BaseException as exc:  # handed to the caller of wait()
            self.error = exc

    def wait(self) -> int:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.page


class ResultsClient(BrokerClient):
    """Talks to the completion stage (`completion.bind`)."""

    def job_status(self, job_id: str) -> dict[str, Any]:
        return self.request(MT.JOB_STATUS, {"job": job_id}, MT.JOB_INFO).meta

    def cancel(self, job_id: str, at_deadline: bool = False) -> dict[str, Any]:
        """Cancel the job; `at_deadline`: because its deadline passed (it ends `expired`)."""
        meta: dict[str, Any] = {"job": job_id}
        if at_deadline:
            meta["reason"] = JobState.EXPIRED.value  # the state it ends in
        return self.request(MT.CANCEL, meta, MT.CANCELLED).meta

    def control(
        self, job_id: str, *, paused: bool | None = None, priority: int | None = None
    ) -> dict[str, Any]:
        """Pause (`paused=True`) or resume the job, and/or set its priority; its JOB_INFO."""
        meta: dict[str, Any] = {"job": job_id}
        if paused is not None:
            meta["paused"] = paused
        if priority is not None:
            meta["priority"] = priority
        return self.request(MT.CONTROL, meta, MT.JOB_INFO).meta

    def fetch(
        self,
        job_id: str,
        out_path: str,
        err_path: str,
        *,
        follow: bool = False,
        everything: bool = False,
        decoders: dict[str, Callable[[list[int]], str]] | None = None,
        progress: Callable[[FetchReport], None] | None = None,
        page_items: int | None = None,
        poll_s: float = 0.2,
    ) -> FetchReport:
        """Write the job's results to out/err, exactly once per custom_id; returns what it did."""
        report = FetchReport()
        decoders = decoders or {}
        fields: dict[str, Any] = {"all": everything}
        if page_items:
            fields["limit"] = page_items
        delivery = Delivery(job_id, fields)

        def ask(meta: dict[str, Any] | None = None) -> wire.Message:
            return self.request(
                MT.FETCH,
                meta or delivery.ask(now()),
                MT.RESULT_PAGE,
                attempts=1_000_000 if follow else None,
                patient=follow,
                accept=lambda answer: delivery.counts(answer.meta),
            )

        message = ask()  # files are made only once the broker answered
        syncing: Syncing | None = None  # the last page written, fsynced on a thread meanwhile
        with ResultFile.open(out_path) as out, ResultFile.open(err_path) as err:
            try:
                while True:
                    info = message.meta
                    report.info = info
                    a = message.arrays
                    n = len(a["index"])
                    if n:
                        ahead = delivery.ahead(info, now())  # the next page, read meanwhile
                        sent = ahead is not None and self._send_ahead(ahead, follow)
                        self._write(job_id, info, a, decoders, out, err, report)
                        report.pages += 1
                        if ahead is None:  # one page at a time (an older completion)
                            out.sync()
                            err.sync()  # both on disk: only now may the page be acknowledged
                            delivery.written(info)
                            delivery.durable(now())
                            message = ask()
                        else:  # the page before is durable once its fsync is done
                            if syncing is not None:
                                delivery.durable_page(syncing.wait(), now())
                            syncing = Syncing((out, err), int(info.get("page") or 0))
                            # unanswered in time: asked again with a new req, as any request
                            message = self._answer(delivery, sent) or ask(delivery.again(now()))
                        if progress is not None:
                            progress(report)
                        continue
                    if delivery.ack:  # a durable page not acknowledged yet: that first
                        message = ask()
                        continue
                    if syncing is not None:  # the last page written: durable, then acked
                        delivery.durable_page(syncing.wait(), now())
                        syncing = None
                        message = ask()
                        continue
                    if not follow or delivery.done(info, n):
                        return report
                    if progress is not None:
                        progress(report)  # nothing new: a periodic line still says where it is
                    time.sleep(poll_s)  # nothing new yet: the job is still running
                    message = ask()
            finally:
                if syncing is not None:
                    syncing.thread.join()  # never close a file under its fsync

    def _send_ahead(self, meta: dict[str, Any], follow: bool) -> bool:
        """Send a FETCH without waiting for its answer; False if it could not go (it is then
        sent again as a request, once the page in hand is written)."""
        try:
            self.contact.before_send(follow or self.patient)
            self.send(MT.FETCH, meta)
        except FabricError:
            return False
        return True

    def _answer(self, delivery: Delivery, sent: bool) -> wire.Message | None:
        """The RESULT_PAGE answering the FETCH sent ahead, if it comes within `timeout_s`
        (None: the caller sends it again, retried with backoff as any request)."""
        deadline = now() + self.timeout_s
        while sent and (left := deadline - now()) > 0:
            try:
                message = wire.recv(self.socket, self.contact.wait_ms(left))
            except WireError:
                return None
            if message is None:
                self.contact.silent()
                continue
            self.contact.heard()
            if message.type == MT.RESULT_PAGE and delivery.counts(message.meta):
                return message
            if message.type == MT.ERROR:
                raise FabricError(f"the broker at {self.address} says: {message.meta['reason']}")
        return None

    def _write(self, job_id, info, a, decoders, out, err, report) -> None:
        models = {int(k): v for k, v in info["models"].items()}
        shapes = {int(k): v for k, v in info["shapes"].items()}
        model_ids = a["model"].astype(np.int64)
        custom_ids = info["custom_ids"]
        names = info.get("names", [])  # the aliases lines gave: row `name` k is names[k - 1]
        if "name" in a:  # one group per (model, name the line gave it)
            if len(a["name"]) != len(model_ids):
                raise PageError(
                    f"job {job_id}: result page column name has {len(a['name'])} entries for "
                    f"{len(model_ids)} items; the broker sent a malformed page, report it"
                )
            model_ids = model_ids | a["name"].astype(np.int64) << 32
        for group in np.unique(model_ids).tolist():
            pick = np.flatnonzero(model_ids == group)
            if len(pick) == len(model_ids):
                payload, offsets = a["payload"], a["offsets"]
            else:
                part = Ragged(a["payload"], a["offsets"]).take(pick)
                payload, offsets = part.values, part.offsets
            page = ResultPage(
                index=a["index"][pick],
                custom_ids=custom_ids
                if len(pick) == len(model_ids)
                else [custom_ids[i] for i in pick.tolist()],
                status=a["status"][pick],
                kind=a["kind"][pick],
                shape=a["shape"][pick],
                prompt_tokens=a["prompt_tokens"][pick],
                payload=payload,
                offsets=offsets,
                part=a["part"][pick] if "part" in a else None,  # fan-out lines, joined
            )
            model, given = models.get(group & 0xFFFFFFFF, ""), group >> 32
            shown = names[given - 1] if 0 < given <= len(names) else model
            context = ExportContext(
                job_id, shown, shapes, decoders.get(model), int(info.get("created_ns") or 0)
            )
            rendered = render_page(page, context)
            if rendered.out_custom_ids is not None:  # keys by custom_id, none made per line
                report.written += out.write_custom_ids(rendered.out, rendered.out_custom_ids)
            else:
                report.written += out.write_page(rendered.out, rendered.out_keys)
            report.errors += err.write_page(rendered.err, rendered.err_keys)


class DispatchClient(BrokerClient):
    """Talks to the dispatch stage (`dispatch.bind`): queue depth, in-flight, workers."""

    def broker_status(self) -> dict[str, Any]:
        return self.request(MT.BROKER_STATUS, {}, MT.BROKER_INFO).meta
