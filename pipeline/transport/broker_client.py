"""One client connection to a broker stage: its socket, its one request/retry loop, its backoff.

Every client program talks to a stage's ROUTER through a `BrokerClient`: the
submit client (ingest/submit_client.py Producer), the results and status
clients (collector/results_client.py), the vectors client
(collector/vectors/client.py). A request is

1. checked against first contact (pipeline/transport/first_contact.py): a broker that is
   surely not listening on this host fails fast; a `patient` client waits;
2. sent, and answered within `wait_s` by the expected message type; an ERROR
   answer raises FabricError with the broker's reason (never retried: the
   broker said no);
3. on silence (or a send that fails), tried again on a fresh socket (so a late
   answer to the old try is never taken for the new one) after `backoff_s`,
   up to `attempts` tries; then BrokerUnavailableError (exit code 6) names
   the address and what to check.

`backoff_s` is the one backoff rule of every client that waits for a broker:
0.2 s doubling to 5 s, with jitter so a fleet of clients does not stampede.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from pipeline.core.errors import BrokerUnavailableError, FabricError, WireError
from pipeline.core.invocation import how_to_serve
from pipeline.transport import wire
from pipeline.transport.first_contact import FirstContact
from pipeline.transport.security import ClientCurve, secure_client

MT = wire.MessageType
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


def backoff_s(tries: int, jitter: bool = True) -> float:
    """How long to wait after `tries` failed tries (1, 2, ...) before the next: 0.2 s doubling
    to 5 s; with `jitter`, 0.5 to 1.5 times that."""
    wait = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** max(0, tries - 1))
    return wait * (0.5 + random.random()) if jitter else wait


class BrokerClient:
    """A DEALER to one broker address; `request` retries with backoff on silence."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        attempts: int = 5,
        curve: ClientCurve | None = None,
        patient: bool = False,
        on_waiting: Callable[[str], None] | None = None,
        send_timeout_ms: int = 1000,
        send_hwm: int | None = None,
    ) -> None:
        """`timeout_s`: how long one try waits for its answer; `attempts`: tries per request.
        `curve`: this client's CURVE keys, for a broker that requires them. `patient`: wait
        for a broker that is not listening yet (one just started) instead of failing fast.
        `on_waiting` hears once "waiting for the broker at ADDR" (pipeline/transport/first_contact.py).
        `send_timeout_ms`, `send_hwm`: the socket's SNDTIMEO and SNDHWM (a windowed sender)."""
        self.address = address
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.curve = curve
        self.patient = patient
        self.send_timeout_ms = send_timeout_ms
        self.send_hwm = send_hwm
        self.context = zmq.Context()
        self.socket: zmq.Socket | None = None
        self.contact = FirstContact(address, on_waiting)  # fail fast if nothing listens
        self._connect()

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
        self.socket = wire.open_socket(
            self.context,
            zmq.DEALER,
            send_timeout_ms=self.send_timeout_ms,
            send_hwm=self.send_hwm,
        )
        secure_client(self.socket, self.curve)
        self.socket.connect(self.address)

    def send(self, kind: MT, meta: dict[str, Any], arrays: dict[str, np.ndarray] | None = None):
        """Send one message without waiting for an answer (BrokerUnavailableError if the
        socket cannot take it within its send timeout)."""
        try:
            wire.send(self.socket, kind, meta, arrays)
        except WireError as exc:
            raise BrokerUnavailableError(
                f"cannot send to the broker at {self.address}: {exc}"
            ) from exc

    def request(
        self,
        kind: MT,
        meta: dict[str, Any],
        answer: MT,
        attempts: int | None = None,
        arrays: dict[str, np.ndarray] | None = None,
        patient: bool = False,
        wait_s: float | None = None,
        accept: Callable[[wire.Message], bool] | None = None,
    ) -> wire.Message:
        """The answer to one request, tried `attempts` times of `wait_s` each (defaults: the
        client's `attempts` and `timeout_s`); `patient`: wait for a broker that is not up yet
        rather than fail fast (pipeline/transport/first_contact.py); `accept`: whether an answer of the
        `answer` type is the one awaited (one that is not is dropped)."""
        attempts = self.attempts if attempts is None else attempts
        wait_s = self.timeout_s if wait_s is None else wait_s
        for attempt in range(attempts):
            try:
                self.contact.before_send(patient or self.patient)
                wire.send(self.socket, kind, meta, arrays)
                deadline = time.monotonic() + wait_s
                while (left := deadline - time.monotonic()) > 0:
                    message = wire.recv(self.socket, self.contact.wait_ms(left))
                    if message is None:
                        self.contact.silent()
                        continue
                    self.contact.heard()
                    if message.type == answer and (accept is None or accept(message)):
                        return message
                    if message.type == MT.ERROR:
                        raise FabricError(
                            f"the broker at {self.address} says: {message.meta['reason']}"
                        )
            except WireError:
                pass
            if attempt + 1 < attempts:
                self._connect()  # a fresh socket: nothing stale is waiting in the old one
                time.sleep(backoff_s(attempt + 1))
        raise BrokerUnavailableError(
            f"no answer from the broker at {self.address} after {attempts} tries of "
            f"{wait_s:g} s; is it running (`{how_to_serve()}`)? "
            "Check --broker / --config, and that it requires no CURVE key or authorizes this "
            "client's (--key, security.client_key)"
        )

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None
        self.context.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
