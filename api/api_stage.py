"""The `api` stage: uvicorn serving the OpenAI Files and Batches API, and (api-0) the batch driver.

`[api] processes = N` runs N of these, each serving HTTP on `[api] bind` (the
port is shared with SO_REUSEPORT, so the kernel spreads connections). Only
api-0 runs the batch driver (api/batch_driver.py), the one writer of batch
records, and the expiry of files (input files after `api.input_file_expiry_s`,
output and error files with their job's retention: api/retention.py); every
process reads the files and batch records from disk.

uvicorn runs on a thread of the stage process, with the `[api]` limits on
request heads, connections and idle time (api/http_limits.py); the stage's own
loop (`step`) drives the batches. SIGTERM (the supervisor stopping the broker) stops the
HTTP server after the requests in flight, then the stage exits; a SIGKILL at
any moment loses nothing acknowledged (docs/http-api.md, "Durability").
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from api.app import make_app
from api.batch_driver import BatchDriver
from api.batch_events import BatchEvents
from api.batch_store import BatchStore
from api.file_store import FileStore
from api.http_limits import HttpLimits, guarded
from api.retention import OutputRetention
from collector.delivery.decoders import model_decoders
from collector.results_client import ResultsClient
from collector.webhook_outbox import Outbox, WebhookSender, sender_thread
from collector.webhooks import Webhooks
from config.stage_settings import ApiStageSettings
from ingest.submit_client import Producer
from pipeline.core.errors import ConfigError
from pipeline.process.stage import Stage
from pipeline.transport.binds import host_port
from pipeline.transport.security import client_curve
from pipeline.transport.topology import client_address

DRIVE_EVERY_S = 0.2
EXPIRE_EVERY_S = 60.0
START_TIMEOUT_S = 30.0


def listening_socket(bind: str, shared: bool) -> socket.socket:
    """A TCP socket listening on HOST:PORT; `shared`: SO_REUSEPORT, for several processes."""
    host, port = host_port(bind)  # api.bind is HOST:PORT (config/rules.py)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"api.bind = {bind!r} cannot be bound: {exc.strerror}; is another server on that "
            "port? Choose a free one"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class ApiStage(Stage[ApiStageSettings]):
    name = "api"
    poll_ms = 100

    def open(self) -> None:
        settings = self.settings
        root = settings.data_path / "api"
        root.mkdir(parents=True, exist_ok=True)
        self.files = FileStore(root)
        self.batches = BatchStore(root)
        if self.index == 0:
            self.files.sweep()
            self.batches.sweep()
        endpoints = tuple(sorted({e for m in settings.models for e in m.endpoints}))
        app = make_app(settings, root, endpoints, client_address(settings.dispatch_bind))
        self.route_stats = app.state.route_stats
        self.dispatch_view = app.state.dispatch_view  # its client to dispatch, closed at the end
        self.sock = listening_socket(settings.api.bind, settings.api.processes > 1)
        config = uvicorn.Config(
            app,
            http=guarded(HttpLimits.of(settings.api)),  # api/http_limits.py
            # uvicorn's annotation says int; its timer takes fractions of a second as they are
            timeout_keep_alive=settings.api.keep_alive_timeout_s,  # type: ignore[arg-type]
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {settings.api.bind} did not start")
            time.sleep(0.01)
        self.driver = None
        self.sender: WebhookSender | None = None
        if self.index == 0:
            webhooks = Webhooks(settings.api)  # collector/webhooks.py: secrets read once, here
            outbox = Outbox(root)
            self.sender = WebhookSender(outbox, webhooks)
            self.stop_sending = threading.Event()
            self.sending = sender_thread(self.sender, self.stop_sending)
            curve = client_curve(settings.security)
            ingest = client_address(settings.ingest_bind)
            self.producers = (
                Producer(ingest, curve=curve, patient=True),
                Producer(ingest, curve=curve, patient=True),
            )
            self.results = ResultsClient(
                client_address(settings.completion_bind), curve=curve, patient=True
            )
            self.driver = BatchDriver(
                self.files,
                self.batches,
                self.producers,
                self.results,
                decoders=model_decoders(settings),  # the text of generated results
                events=BatchEvents(outbox, webhooks),  # each batch's end, for its webhook
            )
            self.retention = OutputRetention(
                self.files,
                self.batches,
                settings.data_path,
                settings.results_retention_s,
            )
        self.next_drive = 0.0
        self.next_retention = 0.0
        self.next_expiry = 0.0
        self.by_status: dict[str, int] = {}
        self.wake = threading.Event()
        self.log.info("serving the OpenAI Batch API on http://%s/v1", settings.api.bind)

    def step(self, now: float) -> None:
        if self.driver is not None and now >= self.next_drive:
            self.by_status = self.driver.step(time.time())  # the driver's clock: the wall's
            self.next_drive = time.monotonic() + DRIVE_EVERY_S
        if self.driver is not None and now >= self.next_expiry:
            self.next_expiry = now + EXPIRE_EVERY_S
            in_use = {b.input_file_id for b in self.batches.all() if not b.ended}
            for file_id in self.files.expire(time.time(), in_use):
                self.log.info("input file %s expired (api.input_file_expiry_s)", file_id)
        if self.driver is not None and now >= self.next_retention:
            # output and error files follow their job's retention, checked as the collector does
            self.next_retention = now + self.settings.sweep_interval_s
            for file_id in self.retention.step(time.time()):
                self.log.info("output file %s expired (completion.results_retention_s)", file_id)
        if not self.thread.is_alive():
            raise RuntimeError("the HTTP server thread stopped")
        if self.sender is not None and not self.sending.is_alive():
            raise RuntimeError("the webhook sender thread stopped")
        self.wake.wait(self.poll_ms / 1000)

    def drain(self, deadline: float) -> None:
        self.server.should_exit = True
        self.thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if getattr(self, "sender", None) is not None:
            self.stop_sending.set()
            self.sending.join()
        if getattr(self, "driver", None) is not None:
            self.driver.close()
            for producer in self.producers:
                producer.close()
            self.results.close()
        if getattr(self, "sock", None) is not None:
            self.sock.close()
        if getattr(self, "dispatch_view", None) is not None:
            self.dispatch_view.close()

    def stats(self, now: float) -> dict | None:
        figures = self.route_stats.stats()
        if self.driver is not None:
            figures["fabric_api_batches"] = {(k,): v for k, v in self.by_status.items()}
        if self.sender is not None:
            figures["fabric_webhooks_events"] = {(k,): v for k, v in self.sender.events.items()}
            figures["fabric_webhooks_attempts_total"] = {
                (k,): v for k, v in self.sender.attempts.items()
            }
        return figures
