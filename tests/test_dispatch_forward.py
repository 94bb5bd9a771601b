"""Results pass through dispatch unparsed (pipeline/transport/wire/forwarded.py): completion receives the
worker's RESULTS frames byte for byte, with the worker's route taken from dispatch's envelope."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from gpu.work_protocol import ITEM_DTYPE
from pipeline.core.errors import WireError
from pipeline.transport import wire
from pipeline.transport.wire import forwarded

MT = wire.MessageType


def results_arrays(n: int = 4) -> dict:
    items = np.zeros(n, ITEM_DTYPE)
    items["slot"] = np.arange(n)
    return {
        "items": items,
        "issued": items.copy(),
        "status": np.zeros(n, np.uint8),
        "kind": np.ones(n, np.uint8),
        "prompt_tokens": np.full(n, 3, np.uint32),
        "payload": np.arange(4 * n, dtype=np.uint8),
        "offsets": np.arange(n + 1, dtype=np.int64) * 4,
    }


@pytest.fixture
def sockets():
    """worker (DEALER) -> dispatch (ROUTER); dispatch (PUSH) -> completion (PULL), inproc."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    dealer.setsockopt(zmq.IDENTITY, b"w-1")
    router.bind("inproc://dispatch")
    dealer.connect("inproc://dispatch")
    pull.bind("inproc://completion")
    push.connect("inproc://completion")
    yield dealer, router, push, pull
    for s in (router, dealer, push, pull):
        s.close(0)
    context.term()


def test_a_worker_s_results_reach_completion_as_sent_with_dispatch_s_route(sockets):
    dealer, router, push, pull = sockets
    meta = {"session": "w-1", "result_id": 7, "batch_id": 9, "token": "t", "route": "ff"}
    wire.send(dealer, MT.RESULTS, meta, results_arrays())
    received = wire.recv(router, 2000)
    frames = forwarded.forwarded(received)
    assert all(a is b for a, b in zip(frames[1:], received.frames, strict=True))  # not rebuilt
    push.send_multipart(frames, copy=False)
    message = forwarded.recv(pull, 2000)
    assert message.type == MT.RESULTS and message.route == (b"w-1",)
    assert message.meta["route"] == b"w-1".hex()  # dispatch's word, not the worker's "ff"
    assert message.meta["result_id"] == 7 and message.meta["token"] == "t"
    for name, array in results_arrays().items():
        assert np.array_equal(message.arrays[name], array)


def test_item_errors_and_malformed_forwards_on_the_completion_inbox(sockets):
    _, _, push, pull = sockets
    items = np.zeros(2, ITEM_DTYPE)
    push.send_multipart(wire.encode(MT.ITEM_ERRORS, {"reason": "r"}, {"items": items}))
    message = forwarded.recv(pull, 2000)
    assert message.type == MT.ITEM_ERRORS and message.route == ()
    push.send_multipart([forwarded.FORWARDED + b"w-1", *wire.encode(MT.PING, {})])
    with pytest.raises(WireError, match="only RESULTS"):
        forwarded.recv(pull, 2000)
    push.send_multipart([forwarded.FORWARDED + b"w-1", b"junk"])
    with pytest.raises(WireError, match="truncated header"):
        forwarded.recv(pull, 2000)
    assert forwarded.recv(pull, 0) is None
