"""The worker's own decisions, without a broker: batch budgets and result messages."""

from __future__ import annotations

import numpy as np

from gpu.dispatch_state import ITEM_DTYPE
from gpu.engines import EchoEngine, EngineResult
from gpu.worker import FIRST_BATCH_TOKENS, Worker, WorkerOptions, results_message


def test_requests_are_sized_from_the_engines_measured_speed():
    worker = Worker(
        WorkerOptions("tcp://127.0.0.1:1", "m", batch_tokens=100_000, target_batch_s=0.2),
        EchoEngine(),
    )
    assert worker.token_budget() == FIRST_BATCH_TOKENS  # nothing measured yet: start small
    worker._measured(tokens=10_000, seconds=1.0)
    assert worker.token_budget() == 2_000  # 10k tokens/s x 0.2 s
    for _ in range(20):
        worker._measured(tokens=10_000_000, seconds=1.0)  # a much faster engine
    assert worker.token_budget() == 100_000  # never above the configured maximum
    fixed = Worker(WorkerOptions("tcp://127.0.0.1:1", "m", target_batch_s=0.0), EchoEngine())
    assert fixed.token_budget() == fixed.options.batch_tokens


def test_an_items_own_error_becomes_its_error_result_beside_the_others_outputs():
    items = np.zeros(3, ITEM_DTYPE)
    tokens = np.arange(6, dtype=np.uint32)
    result = EngineResult(
        [None, "invalid_input: empty", None], tokens=tokens, offsets=np.array([0, 2, 4, 6])
    )
    arrays = results_message(items, np.array([2, 2, 2], np.uint32), result)
    assert arrays["status"].tolist() == [0, 1, 0]
    assert arrays["kind"].tolist() == [0, 2, 0]
    payload, offsets = arrays["payload"], arrays["offsets"]
    assert bytes(payload[offsets[1] : offsets[2]]) == b"invalid_input: empty"
    assert payload[offsets[2] : offsets[3]].view("<u4").tolist() == [4, 5]


def test_a_worker_holding_many_unacknowledged_results_asks_for_no_more_work():
    """Completion not taking results (a full disk): the worker's memory stays bounded."""
    from gpu.worker import MAX_UNACKNOWLEDGED_BATCHES, _Held

    worker = Worker(WorkerOptions("tcp://127.0.0.1:1", "m", prefetch=4), EchoEngine())
    asked = []
    worker._send = lambda kind, meta, arrays=None: asked.append(kind) or True

    def hold(n: int) -> None:
        for batch_id in range(len(worker.held), len(worker.held) + n):
            worker.held[batch_id] = _Held(
                batch_id, np.zeros(1, ITEM_DTYPE), np.ones(1, np.uint32), np.zeros((1, 1)), "e", 1
            )
            worker.held[batch_id].state = "sent"

    hold(MAX_UNACKNOWLEDGED_BATCHES - 1)
    worker._ask(100.0)
    assert len(asked) == 1  # still below the bound: it asks
    worker.asking = False
    hold(1)
    worker._ask(200.0)
    assert len(asked) == 1  # at the bound: it waits for acknowledgements
