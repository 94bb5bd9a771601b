"""Metrics: how a stage reports its own (the catalogue of every metric the broker exposes:
pipeline/telemetry/metric_catalogue.py `METRICS`).

A stage that has figures to show implements `Stage.stats(now)`, returning a
dict from metric name (a key of `METRICS`) to its value: a number for a
metric without labels, a dict from label values (a tuple in the catalogue's
label order) to a number for one with labels, or a `Histogram`. `run_stage`
calls it every `metrics.interval_s` and a `StatsPusher` sends the result to
the supervisor as one STATS message over the `metrics` ipc socket (PUSH,
never blocking: a report the supervisor cannot take is dropped, the next
one replaces it). The supervisor keeps the latest report of each stage
process and serves them all (pipeline/telemetry/metrics_hub.py, metrics_server.py).

STATS meta: `stage` (label, e.g. "writer-0"), `pid`, and `samples`, a list
of `[name, [label values], value]`, where a histogram's value is
`[[count per bucket, the last one +Inf], sum]` (counts not cumulative).

Counters are counted by the stage itself from its start (`carry`: the
supervisor adds what earlier lives of the stage counted, so a restart does
not reset the series) except those a worker reports about itself, which
are the worker's own totals.
"""

from __future__ import annotations

import bisect
import logging
import math
import os

from pipeline.telemetry.metric_catalogue import HISTOGRAM, METRICS
from pipeline.transport.topology import internal_address

log = logging.getLogger("fabric.metrics")


class Histogram:
    """A fixed-bucket histogram a stage fills (`observe`) and reports; not thread-safe."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def wire(self) -> list:
        return [list(self.counts), self.sum]


def encode_samples(stats: dict[str, object]) -> list[list]:
    """A stage's `stats()` as the STATS `samples` list; ValueError names a bad entry."""
    samples: list[list] = []
    for name, value in stats.items():
        metric = METRICS.get(name)
        if metric is None:
            raise ValueError(f"{name!r} is not in pipeline.telemetry.metric_catalogue.METRICS")
        if metric.kind == HISTOGRAM:
            if not isinstance(value, Histogram) or value.bounds != metric.buckets:
                raise ValueError(f"{name} needs a Histogram with the catalogue's buckets")
            samples.append([name, [], value.wire()])
            continue
        series = value if isinstance(value, dict) else {(): value}
        for labels, number in series.items():
            if len(labels) != len(metric.labels):
                raise ValueError(f"{name} takes labels {metric.labels}, got {labels!r}")
            number = float(number)
            if math.isfinite(number):
                samples.append([name, [str(v) for v in labels], number])
    return samples


class StatsPusher:
    """Sends a stage's `stats()` to the supervisor every `metrics.interval_s`.

    The socket is made on the first report; a stage without `stats` never
    makes one. Sending never blocks and never raises: stats are not worth
    slowing a stage for, and the next report replaces a lost one.
    """

    def __init__(self, settings, label: str) -> None:
        self.settings = settings
        self.label = label
        self.interval_s = settings.metrics.interval_s
        self.enabled = bool(settings.metrics.bind)
        self.next_at = 0.0
        self.socket = None
        self.context = None
        self.failed = False

    def maybe_push(self, stage, now: float) -> None:
        if not self.enabled or now < self.next_at:
            return
        self.next_at = now + self.interval_s
        stats = getattr(stage, "stats", None)
        if stats is None:
            self.enabled = False
            return
        try:
            found = stats(now)
            if not found:
                return
            samples = encode_samples(found)
        except Exception:  # a bug in a report must never stop the stage
            if not self.failed:
                log.exception("stage %s: its stats could not be gathered", self.label)
            self.failed = True
            return
        self._send(samples)

    def _send(self, samples: list[list]) -> None:
        import zmq

        from pipeline.core.errors import FabricError
        from pipeline.transport import wire

        if self.socket is None:
            self.context = zmq.Context()
            self.socket = wire.open_socket(
                self.context,
                zmq.PUSH,
                send_hwm=2,
                connect=internal_address(self.settings, "metrics"),
            )
        try:
            wire.send(
                self.socket,
                wire.MessageType.STATS,
                {"stage": self.label, "pid": os.getpid(), "samples": samples},
            )
        except FabricError as exc:  # the supervisor not listening (yet): the next report
            log.debug("stats of %s not sent: %s", self.label, exc)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
            self.context.term()
            self.socket = self.context = None
