"""Dispatch's queue to completion: forwarded RESULTS (framed by pipeline/transport/wire/forwarded.py,
the worker's frames unparsed) and ITEM_ERRORS, in order."""

from __future__ import annotations

import collections
import logging

import numpy as np
import zmq

from pipeline.transport import wire
from pipeline.transport.wire.forwarded import forwarded

MAX_WAITING_FOR_COMPLETION = 2048  # forwarded result batches held while completion is away


class ToCompletion:
    """Dispatch's queue to the completion stage over `socket` (PUSH, SNDTIMEO 0): forwarded
    RESULTS and ITEM_ERRORS, in order; what cannot be sent now waits for the next flush."""

    def __init__(self, socket: zmq.Socket, log: logging.Logger) -> None:
        self.socket = socket
        self.log = log
        self.waiting: collections.deque[list] = collections.deque()  # frames, in order

    def results(self, message: wire.Message) -> None:
        """A worker's RESULTS (checked by the caller), as they came: not re-encoded."""
        if len(self.waiting) >= MAX_WAITING_FOR_COMPLETION:
            self.log.warning("completion is not taking results; dropped one batch (resent later)")
            return  # the worker keeps it unacknowledged and sends it again
        self.waiting.append(forwarded(message))

    def item_errors(self, reason: str, items: np.ndarray) -> None:
        self.waiting.append(
            wire.encode(wire.MessageType.ITEM_ERRORS, {"reason": reason}, {"items": items})
        )

    def flush(self) -> None:
        while self.waiting:
            try:
                self.socket.send_multipart(self.waiting[0], copy=False)
            except zmq.ZMQError:  # SNDTIMEO 0: zmq.Again
                return  # completion restarting or busy: keep them, try on the next step
            self.waiting.popleft()
