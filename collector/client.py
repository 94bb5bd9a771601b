"""The results client: fetch a job's results exactly once, its status, cancel it; broker status.

`python run.py results JOB -o OUT.jsonl [--errors ERR.jsonl] [--follow] [--all]`
runs `ResultsClient.fetch`. Each page is written to OUT and ERR (lines a file
already holds are skipped, so a re-run after a crash writes each custom_id
once), both files are fsynced, and only then is the page acknowledged, with
the next request (invariant 12). A broker that goes away is retried with
backoff; with `follow` the client keeps going until the job is finished.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from collector.delivery.lines import ExportContext, ResultPage, format_page, page_keys
from collector.delivery.result_file import ResultFile
from pipeline import wire
from pipeline.errors import BrokerUnreachableError, FabricError, WireError
from pipeline.first_contact import FirstContact
from pipeline.ragged import Ragged
from pipeline.security import ClientCurve, secure_client

MT = wire.MessageType
TERMINAL = ("completed", "cancelled", "expired")


@dataclass
class FetchReport:
    written: int = 0  # output lines written in this run
    errors: int = 0  # error lines written in this run
    pages: int = 0
    info: dict[str, Any] | None = None


class Client:
    """A DEALER to one broker address; `request` retries with backoff on silence."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        attempts: int = 5,
        curve: ClientCurve | None = None,
        patient: bool = False,
        on_waiting: Callable[[str], None] | None = None,
    ) -> None:
        """`curve`: this client's CURVE keys, for a broker that requires them. `patient`: wait
        for a broker that is not listening yet (one just started) instead of failing fast.
        `on_waiting` hears once "waiting for the broker at ADDR" (pipeline/first_contact.py)."""
        self.address = address
        self.patient = patient
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.curve = curve
        self.context = zmq.Context()
        self.socket = None
        self.contact = FirstContact(address, on_waiting)  # fail fast if nothing listens
        self._connect()

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 1000)
        secure_client(self.socket, self.curve)
        self.socket.connect(self.address)

    def request(
        self,
        kind: MT,
        meta: dict,
        answer: MT,
        attempts: int | None = None,
        arrays: dict | None = None,
        patient: bool = False,
    ) -> wire.Message:
        """The answer to one request, tried `attempts` times; `patient`: wait for a broker
        that is not up yet rather than fail fast (pipeline/first_contact.py)."""
        attempts = self.attempts if attempts is None else attempts
        backoff = 0.2
        for attempt in range(attempts):
            try:
                self.contact.before_send(patient or self.patient)
                wire.send(self.socket, kind, meta, arrays)
                deadline = time.monotonic() + self.timeout_s
                while (left := deadline - time.monotonic()) > 0:
                    message = wire.recv(self.socket, self.contact.wait_ms(left))
                    if message is None:
                        self.contact.silent()
                        continue
                    self.contact.heard()
                    if message.type == answer:
                        return message
                    if message.type == MT.ERROR:
                        raise FabricError(
                            f"the broker at {self.address} says: {message.meta['reason']}"
                        )
            except WireError:
                pass
            if attempt + 1 < attempts:
                self._connect()  # a fresh socket: nothing stale is waiting in the old one
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(5.0, backoff * 2)
        raise BrokerUnreachableError(
            f"no answer from the broker at {self.address} after {attempts} tries of "
            f"{self.timeout_s:g} s; is it running (python run.py --config FILE)? "
            "Check --broker / --config, and that it requires no CURVE key or authorizes this "
            "client's (--key, security.client_key)"
        )

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
        self.context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResultsClient(Client):
    """Talks to the completion stage (`completion.bind`)."""

    def job_status(self, job_id: str) -> dict[str, Any]:
        return self.request(MT.JOB_STATUS, {"job": job_id}, MT.JOB_INFO).meta

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.request(MT.CANCEL, {"job": job_id}, MT.CANCELLED).meta

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
        ack = 0
        cursors: list = []

        def ask() -> wire.Message:
            meta = {"job": job_id, "ack": ack, "all": everything}
            if page_items:
                meta["limit"] = page_items
            if everything:
                meta["cursors"] = cursors
            return self.request(
                MT.FETCH,
                meta,
                MT.RESULT_PAGE,
                attempts=1_000_000 if follow else None,
                patient=follow,
            )

        message = ask()  # files are made only once the broker answered
        with ResultFile.open(out_path) as out, ResultFile.open(err_path) as err:
            while True:
                info = message.meta
                report.info = info
                ack = 0
                a = message.arrays
                n = len(a["index"])
                if n:
                    self._write(job_id, info, a, decoders, out, err, report)
                    out.sync()
                    err.sync()  # both on disk: only now may the page be acknowledged
                    ack = int(info["page"])
                    cursors = info.get("cursors", [])
                    report.pages += 1
                    if progress is not None:
                        progress(report)
                    message = ask()
                    continue
                finished = info["state"] in TERMINAL and (everything or not info.get("undelivered"))
                if not follow or finished or (everything and n == 0 and not follow):
                    return report
                if progress is not None:
                    progress(report)  # nothing new: a periodic line still says where it stands
                time.sleep(poll_s)  # nothing new yet: the job is still running
                message = ask()

    def _write(self, job_id, info, a, decoders, out, err, report) -> None:
        models = {int(k): v for k, v in info["models"].items()}
        shapes = {int(k): v for k, v in info["shapes"].items()}
        model_ids = a["model"]
        for model_id in np.unique(model_ids).tolist():
            pick = np.flatnonzero(model_ids == model_id)
            if len(pick) == len(model_ids):
                payload, offsets = a["payload"], a["offsets"]
            else:
                rows = Ragged(a["payload"], a["offsets"].astype(np.int64)).take(pick)
                payload, offsets = rows.values, rows.offsets
            page = ResultPage(
                index=a["index"][pick],
                custom_ids=[info["custom_ids"][i] for i in pick.tolist()],
                status=a["status"][pick],
                kind=a["kind"][pick],
                shape=a["shape"][pick],
                prompt_tokens=a["prompt_tokens"][pick],
                payload=payload,
                offsets=offsets,
            )
            model = models.get(model_id, "")
            context = ExportContext(
                job_id, model, shapes, decoders.get(model), int(info.get("created_ns") or 0)
            )
            out_lines, err_lines = format_page(page, context)
            out_keys, err_keys = page_keys(page, context)
            report.written += out.write(out_lines, out_keys)
            report.errors += err.write(err_lines, err_keys)


class DispatchClient(Client):
    """Talks to the dispatch stage (`dispatch.bind`): queue depth, in-flight, workers."""

    def broker_status(self) -> dict[str, Any]:
        return self.request(MT.BROKER_STATUS, {}, MT.BROKER_INFO).meta
