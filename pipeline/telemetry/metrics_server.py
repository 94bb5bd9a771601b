"""The supervisor's metrics thread: stage reports in over ZeroMQ, Prometheus text out over HTTP.

| socket / port   | kind      | peer                                                      |
|-----------------|-----------|-----------------------------------------------------------|
| `metrics` ipc   | PULL      | every stage process: STATS (pipeline/telemetry/metrics.py)          |
| `metrics.bind`  | HTTP      | Prometheus: GET /metrics, text exposition format           |
|                 |           | probes: GET /live, GET /ready (pipeline/telemetry/health.py) |

The thread only moves reports into the `MetricsHub`; the HTTP server
(prometheus_client's WSGI app, on its own daemon thread) renders the hub, the restart
counts and the disk figures when scraped, so a scrape costs the stages
nothing. Neither a port that cannot be bound nor a malformed report stops
the broker: the first is logged as an error, the second as a warning.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import shutil
import threading
import time
from collections.abc import Iterator

from pipeline.core.wake_pipe import WakePipe
from pipeline.store.datadir import DataDir
from pipeline.store.segment_format import SUFFIX
from pipeline.telemetry.health import Health, with_probes
from pipeline.telemetry.metric_catalogue import COUNTER, GAUGE, HISTOGRAM, METRICS
from pipeline.telemetry.metrics_hub import MetricsHub
from pipeline.transport.binds import host_port
from pipeline.transport.topology import internal_address

log = logging.getLogger("fabric.metrics")


def _http_server(host: str, port: int, app, wake: WakePipe):
    """prometheus_client's threading WSGI server running `app` on `host:port`, and the daemon
    thread serving it
    that waits for a connection or `wake` (prometheus_client's own `start_http_server`, and
    socketserver's `serve_forever`, look for a stop every 0.5 s, which every broker stop
    waited out). Raises OSError when it cannot listen."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            """A scrape is not worth a line on stderr."""

    httpd = make_server(host, port, app, Server, handler_class=QuietHandler)
    httpd.timeout = 0.5  # a connection gone before its accept: handle_request waits no longer
    thread = threading.Thread(target=_serve, args=(httpd, wake), name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


def _serve(httpd, wake: WakePipe) -> None:
    """Answer each connection (a thread each: ThreadingWSGIServer) until `wake` is woken."""
    with selectors.DefaultSelector() as selector:
        selector.register(httpd, selectors.EVENT_READ)
        selector.register(wake.fd, selectors.EVENT_READ)
        while True:
            ready = {key.fileobj for key, _ in selector.select()}
            if wake.fd in ready:
                return
            httpd.handle_request()  # the connection waiting now: accept returns at once


def valid_samples(samples: object) -> list[list] | None:
    """The samples of a STATS report if every one is well formed, else None."""
    if not isinstance(samples, list):
        return None
    for sample in samples:
        if not (isinstance(sample, list) and len(sample) == 3):
            return None
        name, labels, value = sample
        metric = METRICS.get(name) if isinstance(name, str) else None
        if metric is None or not isinstance(labels, list) or len(labels) != len(metric.labels):
            return None
        if not all(isinstance(v, str) for v in labels):
            return None
        if metric.kind == HISTOGRAM:
            ok = (
                isinstance(value, list)
                and len(value) == 2
                and isinstance(value[0], list)
                and len(value[0]) == len(metric.buckets) + 1
                and all(isinstance(c, int) and c >= 0 for c in value[0])
                and isinstance(value[1], int | float)
            )
        else:
            ok = isinstance(value, int | float) and math.isfinite(value)
        if not ok:
            return None
    return samples


def disk_figures(data_dir: DataDir) -> dict[tuple[str, tuple[str, ...]], float]:
    """Segment files and their allocated bytes per log, and free bytes on the data dir's disk."""
    figures: dict[tuple[str, tuple[str, ...]], float] = {}
    for log_name, directory in (("input", data_dir.segments), ("completion", data_dir.completion)):
        files = used = 0
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if not entry.name.endswith(SUFFIX):
                        continue
                    try:
                        used += entry.stat().st_blocks * 512
                    except FileNotFoundError:  # collected meanwhile
                        continue
                    files += 1
        except FileNotFoundError:
            pass
        figures[("fabric_segment_files", (log_name,))] = files
        figures[("fabric_segment_bytes", (log_name,))] = used
    try:
        figures[("fabric_disk_free_bytes", ())] = shutil.disk_usage(data_dir.root).free
    except OSError as exc:
        log.warning("cannot read free space of %s: %s", data_dir.root, exc)
    return figures


class FabricCollector:
    """A prometheus_client collector rendering the hub, restarts and disk figures per scrape."""

    def __init__(self, hub: MetricsHub, data_dir: DataDir) -> None:
        self.hub = hub
        self.data_dir = data_dir

    def collect(self) -> Iterator:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        values, histograms = self.hub.snapshot()
        for stage, n in self.hub.restarts().items():
            values[("fabric_stage_restarts_total", (stage,))] = n
        for stage, up in self.hub.up().items():
            values[("fabric_stage_up", (stage,))] = 1.0 if up else 0.0
        for stage, (in_a_row, wait_s) in self.hub.crash_loops(time.monotonic()).items():
            values[("fabric_stage_deaths_in_a_row", (stage,))] = in_a_row
            values[("fabric_stage_restart_wait_seconds", (stage,))] = wait_s
        values.update(disk_figures(self.data_dir))
        by_name: dict[str, list] = {}
        for (name, labels), value in sorted(values.items()):
            by_name.setdefault(name, []).append((labels, value))
        for (name, labels), value in sorted(histograms.items()):
            by_name.setdefault(name, []).append((labels, value))
        for name, metric in METRICS.items():
            series = by_name.get(name, [])
            labels = list(metric.labels)
            if metric.kind == COUNTER:
                family = CounterMetricFamily(name, metric.help, labels=labels)
                for label_values, value in series:
                    family.add_metric(list(label_values), value)
            elif metric.kind == GAUGE:
                family = GaugeMetricFamily(name, metric.help, labels=labels)
                for label_values, value in series:
                    family.add_metric(list(label_values), value)
            else:
                family = HistogramMetricFamily(name, metric.help, labels=labels)
                for label_values, (counts, total) in series:
                    cumulative, running = [], 0
                    for bound, count in zip((*metric.buckets, math.inf), counts, strict=True):
                        running += count
                        cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), running))
                    family.add_metric(list(label_values), cumulative, total)
            yield family


class MetricsServer(threading.Thread):
    """Receives the stages' STATS into `hub` and serves Prometheus metrics on `metrics.bind`."""

    def __init__(self, settings, hub: MetricsHub, health: Health | None = None) -> None:
        super().__init__(name="metrics", daemon=True)
        self.settings = settings
        self.hub = hub
        self.health = health or Health()  # answers /live and /ready beside /metrics
        self.bind = settings.metrics.bind
        self.httpd = None
        self._http_thread: threading.Thread | None = None
        self._wake = WakePipe()  # stop() makes it readable: both threads' waits end at once
        self._bad_reports = 0

    def start(self) -> None:
        """Serve HTTP (if `metrics.bind` is set) and start taking reports."""
        if not self.bind:
            return
        from prometheus_client import CollectorRegistry, make_wsgi_app

        registry = CollectorRegistry(auto_describe=False)
        registry.register(FabricCollector(self.hub, DataDir(self.settings.data_path)))
        target = host_port(self.bind)  # config/rules.py checked it is HOST:PORT
        assert target is not None, self.bind
        host, port = target
        try:
            app = with_probes(self.health, make_wsgi_app(registry))
            self.httpd, self._http_thread = _http_server(host, port, app, self._wake)
        except OSError as exc:
            log.error(
                "metrics endpoint %s: cannot listen (%s); serving no metrics: "
                "set [metrics] bind to a free HOST:PORT",
                self.bind,
                exc,
            )
            return
        log.info("metrics served on http://%s/metrics", self.bind)
        super().start()

    def run(self) -> None:
        import zmq

        from pipeline.core.errors import WireError
        from pipeline.transport import wire

        context = zmq.Context()
        socket = wire.open_socket(context, zmq.PULL, recv_hwm=1000)
        try:
            socket.bind(internal_address(self.settings, "metrics"))
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(self._wake.fd, zmq.POLLIN)
            while True:
                if self._wake.fd in dict(poller.poll()):
                    return
                try:
                    message = wire.recv(socket, 0)
                except WireError as exc:
                    self._refuse(f"malformed: {exc}")
                    continue
                if message is None:
                    continue
                meta = message.meta
                if message.type != wire.MessageType.STATS:
                    self._refuse(f"{message.type.name} is not a STATS report")
                    continue
                samples = valid_samples(meta["samples"])
                if samples is None:
                    self._refuse(f"the report of {meta['stage']!r} has a malformed sample")
                    continue
                self.hub.update(meta["stage"], meta["pid"], samples)
        except zmq.ZMQError as exc:
            log.error("metrics socket: %s; stage statistics are no longer gathered", exc)
        finally:
            socket.close(0)
            context.term()

    def _refuse(self, why: str) -> None:
        self._bad_reports += 1
        if self._bad_reports <= 10:
            log.warning("stats report dropped: %s", why)

    def stop(self) -> None:
        self._wake.wake()
        threads = [t for t in (self, self._http_thread) if t is not None and t.is_alive()]
        for thread in threads:
            thread.join(timeout=2.0)
        if self.httpd is not None:
            self.httpd.server_close()
        if not any(thread.is_alive() for thread in threads):
            self._wake.close()
