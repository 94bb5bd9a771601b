"""A client's first contact with a broker: say where it waits, and fail fast when nothing listens.

A ZeroMQ client never hears "connection refused": it queues the request and
waits. So until a broker first answers, the clients (ingest/submit_client.py Producer,
collector/results_client.py ResultsClient, through pipeline/transport/broker_client.py) do two things here:

* Before each request, probe what can be known at once on this host: a TCP
  port on loopback (127.x, localhost, ::1) that refuses a plain connect, or
  an ipc path that does not exist, means no broker runs there. The probe is
  repeated for `GRACE_S` (a broker that is just starting binds in that time),
  then BrokerUnavailableError names the address (exit code 6).
  A patient client (`results --follow`) keeps waiting instead.
* After `SAY_AFTER_S` without an answer, the client's `on_waiting` (run.py
  passes one that prints a line on stderr) hears once "waiting for the broker
  at ADDR".

Addresses on other hosts are not probed: a firewall may drop the probe and a
CURVE broker sees a plain connect as noise; the client's own timeout applies.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable

from pipeline.core.errors import BrokerUnavailableError
from pipeline.core.invocation import how_to_serve
from pipeline.transport.binds import host_port

SAY_AFTER_S = 1.0
GRACE_S = 2.0
PROBE_EVERY_S = 0.25
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def refused(address: str) -> str | None:
    """Why nothing can be listening at `address`, if this host can tell at once; else None."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if path.startswith("@"):  # an abstract socket has no file to look for
            return None
        return None if os.path.exists(path) else f"there is no socket file {path}"
    target = host_port(address) if address.startswith("tcp://") else None
    if target is None:
        return None
    host, port = target
    if not (host.startswith("127.") or host in LOOPBACK_NAMES):
        return None
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return None
    except ConnectionRefusedError:
        return f"nothing listens on {host}:{port} (connection refused)"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return f"nothing listens on {host}:{port} (connection refused)"
        return None  # a timeout or another error: let the client's own wait decide


class FirstContact:
    """One client's state until its broker first answers."""

    def __init__(self, address: str, on_waiting: Callable[[str], None] | None = None) -> None:
        """`on_waiting` hears once "waiting for the broker at ADDR" when a second passed."""
        self.address = address
        self.on_waiting = on_waiting
        self.answered = False
        self.started: float | None = None
        self.said = False

    def before_send(self, patient: bool = False) -> None:
        """BrokerUnavailableError if nothing listens at the address for GRACE_S; a `patient`
        client (`results --follow`, which waits out broker restarts) only says it waits."""
        if self.answered:
            return
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if patient:
            self.silent()
            return
        deadline = now + GRACE_S
        while (why := refused(self.address)) is not None:
            if time.monotonic() >= deadline:
                raise BrokerUnavailableError(
                    f"no broker answers at {self.address}: {why}; is it running? Start one "
                    f"with `{how_to_serve()}`, or check --broker / --config"
                )
            self.silent()
            time.sleep(PROBE_EVERY_S)

    def wait_ms(self, left_s: float) -> int:
        """How long to wait for an answer now: up to `left_s`, but wake to say we wait."""
        if not (self.answered or self.said) and self.started is not None:
            left_s = min(left_s, max(0.0, self.started + SAY_AFTER_S - time.monotonic()))
        return int(left_s * 1000) + 1

    def silent(self) -> None:
        """No answer yet: after SAY_AFTER_S, say once where we wait."""
        if self.answered or self.said or self.started is None:
            return
        if time.monotonic() - self.started >= SAY_AFTER_S:
            self.said = True
            if self.on_waiting is not None:
                self.on_waiting(f"waiting for the broker at {self.address}")

    def heard(self) -> None:
        self.answered = True
