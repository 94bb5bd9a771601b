"""The worker's own decisions, without a broker: batch budgets and result messages."""

from __future__ import annotations

import time

import numpy as np
import pytest
from smollm2 import with_torch
from test_dispatch_pipeline import broker, workers  # noqa: F401 (fixtures)

from gpu.engines.base import EngineResult
from gpu.engines.echo import EchoEngine
from gpu.work_protocol import ITEM_DTYPE
from gpu.worker.options import WorkerOptions
from gpu.worker.results import results_message
from gpu.worker.session import FIRST_BATCH_TOKENS, Worker


def test_requests_are_sized_from_the_engines_measured_speed():
    worker = Worker(
        WorkerOptions("tcp://127.0.0.1:1", "m", batch_tokens=100_000, target_batch_s=0.2),
        EchoEngine(),
    )
    assert worker.token_budget() == FIRST_BATCH_TOKENS  # nothing measured yet: start small
    worker.engine_thread.measured(tokens=10_000, seconds=1.0)
    assert worker.token_budget() == 2_000  # 10k tokens/s x 0.2 s
    for _ in range(20):
        worker.engine_thread.measured(tokens=10_000_000, seconds=1.0)  # a much faster engine
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
    from gpu.worker.held import Held
    from gpu.worker.session import MAX_UNACKNOWLEDGED_BATCHES

    worker = Worker(WorkerOptions("tcp://127.0.0.1:1", "m", prefetch=4), EchoEngine())
    asked = []
    worker._send = lambda kind, meta, arrays=None: asked.append(kind) or True

    def hold(n: int) -> None:
        for batch_id in range(len(worker.held), len(worker.held) + n):
            worker.held[batch_id] = Held(
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


class _Gate:
    """An engine that blocks each batch until released, and fails when told to."""

    name = "gate"

    def __init__(self) -> None:
        import threading

        self.go = threading.Event()
        self.fail = False
        self.why: str | None = None  # what `broken` says (vLLM: its engine process died)

    def load(self) -> None:
        pass

    def broken(self) -> str | None:
        return self.why

    def close(self) -> None:
        pass

    def run(self, batch):
        self.go.wait(30)
        if self.fail:
            raise RuntimeError("the device is gone")
        return EchoEngine().run(batch)


def _worker_with(engine, **options):
    from pipeline.transport import wire

    worker = Worker(WorkerOptions("tcp://127.0.0.1:1", "m", **options), engine)
    sent = []
    worker._send = lambda kind, meta, arrays=None: sent.append((kind, meta, arrays)) or True
    worker.open()
    worker.registration.registered = True
    worker.registration.report_s = 1e9

    def work(batch_id: int, slots: list[int], task: str = "embed") -> None:
        items = np.zeros(len(slots), ITEM_DTYPE)
        items["segment"], items["slot"], items["seq"] = 1, slots, slots
        words = np.zeros((len(slots), 8 + 4), np.uint32)
        words[:, 8] = np.array(slots) + 100
        meta = {"batch_id": batch_id, "lane": 4, "task": task, "max_tokens": 4}
        arrays = {"items": items, "lengths": np.ones(len(slots), np.uint32), "slots": words}
        worker._handle(wire.Message(wire.MessageType.WORK, meta, arrays), 0.0)

    return worker, sent, work


def _welcome(worker, known: list[int]) -> None:
    from pipeline.transport import wire

    meta = {"epoch": 1, "report_s": 1e9}
    arrays = {"known": np.array(known, np.uint8)}
    worker._welcome(wire.Message(wire.MessageType.WELCOME, meta, arrays), 0.0)


def _kinds(sent) -> list[str]:
    return [kind.name for kind, _, _ in sent]


def test_re_registration_never_changes_a_batch_under_the_engine():
    """The issue's sequence: re-registered while a batch runs and one waits; the broker says
    none of them is live. The waiting batch is skipped, the running one finishes whole, and
    results come only for live items; the engine goes on to the next batch."""
    from conftest import wait_for

    engine = _Gate()
    worker, sent, work = _worker_with(engine, prefetch=8)
    try:
        work(1, [0, 1, 2])
        wait_for(lambda: worker.engine_thread.running is not None, "batch 1 to run")
        work(2, [3, 4])
        _welcome(worker, [1, 0, 1, 0, 0])  # slots 1, 3 and 4 are retired elsewhere
        assert worker._held_items()["slot"].tolist() == [0, 2]
        assert worker.held[1].items["slot"].tolist() == [0, 1, 2]  # the running batch: whole
        assert 2 not in worker.held  # the waiting one: nothing live, skipped
        engine.go.set()
        wait_for(
            lambda: (worker.step(time.monotonic(), 0), "RESULTS" in _kinds(sent))[1],
            "batch 1's results",
        )
        results = next(a for k, _, a in sent if k.name == "RESULTS")
        assert results["items"]["slot"].tolist() == [0, 2]
        assert results["payload"].view("<f4").reshape(2, 4)[:, 0].tolist() == [100.0, 102.0]
        work(3, [5])
        wait_for(
            lambda: (worker.step(time.monotonic(), 0), _kinds(sent).count("RESULTS") == 2)[1],
            "batch 3",
        )
        assert worker.exit_code is None and worker.engine_thread.is_alive()
    finally:
        engine.go.set()
        worker.close()


def test_a_finished_batch_ends_the_workers_wait_and_its_results_go_at_once():
    """The network thread waits on its socket; a batch the engine finishes meanwhile ends that
    wait, so its results go within the same step (and the next step asks for the next batch), not
    at the poll's timeout: each batch's results were up to a poll late, the job's last one too."""
    import threading
    import time

    engine = _Gate()
    worker, sent, work = _worker_with(engine, prefetch=1)
    try:
        work(1, [0, 1])
        release = threading.Timer(0.2, engine.go.set)  # the engine finishes during the wait
        release.start()
        began = time.monotonic()
        worker.step(time.monotonic(), timeout_ms=10_000)
        waited = time.monotonic() - began
        release.join()
        assert "RESULTS" in _kinds(sent), _kinds(sent)
        assert waited < 5.0, f"the step waited {waited:.1f} s for a batch done after 0.2 s"
        worker.step(time.monotonic(), timeout_ms=0)
        assert "WORK_REQUEST" in _kinds(sent)  # its slot is free: the next batch asked for
    finally:
        engine.go.set()
        worker.close()


def test_an_idle_worker_waits_for_the_broker_until_its_next_timer():
    """Woken by messages and finished batches, the worker waits on its own timers only: it
    woke every 20 ms, more than 1% of a core idle or beside a busy engine."""
    worker, _, _ = _worker_with(EchoEngine())
    waits = []
    worker.connection.poll = lambda timeout_ms: waits.append(timeout_ms) or False
    try:
        now = 1000.0  # the session's clock is its step's now
        worker.step(now)
        assert waits[-1] > 20, waits  # nothing due: the longest wait (IDLE_WAIT_MS)
        worker.pause_until = now + 0.03  # a pause ends in 30 ms: waited for exactly
        worker.step(now)
        assert waits[-1] == 30, waits
        worker.registration.registered = False  # registering: the next hello, due in 50 ms
        worker.registration.next_try = now + 0.05
        worker.step(now)
        assert waits[-1] == 50, waits
    finally:
        worker.close()


def test_a_worker_whose_engine_failed_on_a_batch_it_no_longer_holds_hands_back_and_exits():
    from conftest import wait_for

    from pipeline.core import exitcodes

    engine = _Gate()
    worker, sent, work = _worker_with(engine)
    try:
        work(1, [0, 1])
        wait_for(lambda: worker.engine_thread.running is not None, "batch 1 to run")
        work(2, [2, 3])
        del worker.held[1]  # acknowledged or dropped meanwhile: the engine still fails on it
        engine.fail = True
        engine.go.set()
        wait_for(
            lambda: (worker.step(time.monotonic(), 0), worker.exit_code is not None)[1],
            "the worker to end",
        )
        assert worker.exit_code == exitcodes.FAILED
        backs = [a["items"]["slot"].tolist() for k, _, a in sent if k.name == "HAND_BACK"]
        assert backs == [[2, 3]] and _kinds(sent)[-1] == "BYE"
        assert not worker.held
    finally:
        engine.go.set()
        worker.close()


def test_a_worker_whose_engine_says_it_is_broken_hands_back_while_the_batch_still_runs():
    from conftest import wait_for

    from pipeline.core import exitcodes

    engine = _Gate()
    worker, sent, work = _worker_with(engine)
    try:
        work(1, [0, 1])
        wait_for(lambda: worker.engine_thread.running is not None, "batch 1 to run")
        work(2, [2, 3])
        worker.step(0)
        assert worker.exit_code is None
        engine.why = "vLLM's process EngineCore_DP0 (pid 1234) exited (-9)"  # run never returns
        worker.step(0)
        assert worker.exit_code == exitcodes.FAILED and "EngineCore_DP0" in worker.broken
        backs = [a["items"]["slot"].tolist() for k, _, a in sent if k.name == "HAND_BACK"]
        assert sorted(backs) == [[0, 1], [2, 3]] and _kinds(sent)[-1] == "BYE"
    finally:
        engine.go.set()
        worker.close()


def test_a_worker_whose_engine_thread_ended_or_took_no_work_hands_back_and_exits():
    import threading
    import time

    from conftest import wait_for

    from pipeline.core import exitcodes

    worker, sent, work = _worker_with(_Gate())
    worker.engine_thread.stop(5)  # the engine thread ends, whatever the cause
    work(1, [0, 1])
    worker.step(time.monotonic(), 0)
    assert worker.exit_code == exitcodes.FAILED and "engine thread" in worker.broken
    assert [a["items"]["slot"].tolist() for k, _, a in sent if k.name == "HAND_BACK"] == [[0, 1]]
    worker.close()

    stuck, sent, work = _worker_with(_Gate(), batch_timeout_s=0.3)
    stuck.engine_thread.stop(5)
    blocked = threading.Event()
    stuck.engine_thread.thread = threading.Thread(target=blocked.wait, daemon=True)  # alive
    stuck.engine_thread.thread.start()  # and takes nothing
    try:
        work(1, [0, 1])
        stuck.step(time.monotonic(), 0)
        assert stuck.exit_code is None  # held, not running: not for batch_timeout_s yet
        stuck.watchdog.stalled_since = stuck.watchdog.last_look = (
            time.monotonic() - 5.0
        )  # a SIGSTOP
        stuck.step(time.monotonic(), 0)
        assert stuck.exit_code is None  # the process itself did not run: the clock restarts
        wait_for(  # looked at often: a long gap between looks reads as a SIGSTOP
            lambda: (stuck.step(time.monotonic(), 0), stuck.exit_code is not None)[1],
            "the watchdog",
            interval_s=0.02,
        )
        assert "takes no work" in stuck.broken
        assert [a["items"]["slot"].tolist() for k, _, a in sent if k.name == "HAND_BACK"] == [
            [0, 1]
        ]
    finally:
        blocked.set()
        stuck.close()


# ---- out of memory: one rule for every engine (invariant 14) -----------------------------------
def _minilm_out_of_memory():
    from test_minilm import _FailingSession

    from gpu.engines.minilm import MiniLMEngine

    engine = MiniLMEngine(threads=1)
    engine._session = _FailingSession(
        RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory for buffer")
    )
    return engine, "embed"


def _transformers_out_of_memory():
    import torch

    from gpu.engines.transformers import TransformersEngine

    class Model:
        def generate(self, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine = TransformersEngine()
    engine._model, engine._torch, engine.vocab_size, engine.context_tokens = (
        Model(),
        torch,
        1000,
        64,
    )
    return engine, "generate"


def _vllm_out_of_memory():
    from types import SimpleNamespace

    import gpu.engines.vllm as ve

    class LLM:  # vllm.LLM's surface, started; it runs out of memory after its warm-up
        llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: 1000, max_model_len=64)
        )
        warmed = False

        def get_tokenizer(self):
            return SimpleNamespace(decode=str)

        def generate(self, prompts, params, use_tqdm):
            if not self.warmed:
                self.warmed = True
                done = SimpleNamespace(token_ids=[5], finish_reason="length", stop_reason=None)
                return [SimpleNamespace(outputs=[done])]
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB (vLLM, a fake)")

    real = ve.vllm_installed
    ve.vllm_installed = lambda: True  # vLLM's glue on a stand-in: vllm itself is not needed
    try:
        engine = ve.VllmEngine(model="stand-in")
    finally:
        ve.vllm_installed = real
    engine.attach(LLM(), lambda **params: SimpleNamespace(**params))
    return engine, "generate"


def _echo_out_of_memory():
    # the batch of two runs out of memory, then its first item alone (Engine.run halves a
    # batch before it hands it back)
    engine = EchoEngine(oom_token=100, oom_times=2)
    return engine, "embed"


@pytest.mark.parametrize(
    "engine_of",
    [_echo_out_of_memory, _minilm_out_of_memory, _transformers_out_of_memory, _vllm_out_of_memory],
    ids=["echo", "minilm", "transformers", "vllm"],
)
@with_torch
def test_out_of_memory_in_any_engine_hands_the_batch_back_without_an_attempt(engine_of):
    from conftest import wait_for

    engine, task = engine_of()
    engine.load = lambda: None  # started above, on stand-ins
    worker, sent, work = _worker_with(engine)
    try:
        work(1, [0, 1], task)
        wait_for(
            lambda: (worker.step(time.monotonic(), 0), "HAND_BACK" in _kinds(sent))[1],
            "the hand-back",
        )
        (back,) = [(m, a) for k, m, a in sent if k.name == "HAND_BACK"]
        assert back[0]["count_attempt"] is False, back[0]
        assert "out of memory" in back[0]["reason"] and engine.name in back[0]["reason"]
        assert back[1]["items"]["slot"].tolist() == [0, 1]
        assert (
            worker.exit_code is None and worker.engine_thread.is_alive()
        )  # the engine is not broken
        assert worker.pause_until > 0  # it backs off before asking again
    finally:
        worker.close()


@pytest.mark.slow
def test_a_real_worker_whose_engine_runs_out_of_memory_hands_back_and_finishes_the_job(
    tmp_path,
    broker,  # noqa: F811 (the fixture)
    workers,  # noqa: F811
):
    """`run.py worker` against a real broker: its engine runs out of memory more times than
    max_attempts (3). Were an attempt counted, the items would be dead-lettered (and before the
    one rule, a worker whose engine was not minilm or transformers exited 7). The job finishes
    with every result, once, and the worker lives on."""
    import json

    from broker import submit
    from conftest import wait_for
    from test_dispatch_pipeline import assert_each_once, fetch, finished, job_info, stop_and_check

    b = broker(workers=0)
    data = tmp_path / "oom.jsonl"
    body = {"model": "echo", "prompt_token_ids": [7, 1, 2]}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
        for i in range(20)
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert submit(b.config, data, "--job-id", "oom").returncode == 0
    worker = workers(b, "echo", "oom_token=7", "oom_times=5")  # 5 > max_attempts = 3
    wait_for(lambda: finished(b, "oom"), "the job to finish despite 5 out-of-memory errors", 60)
    assert worker.poll() is None, "the worker lives on: out of memory is transient"
    info = job_info(b, "oom")
    assert (info["completed"], info["failed"]) == (20, 0), info
    out = tmp_path / "oom.out.jsonl"
    assert fetch(b, "oom", out).returncode == 0
    assert_each_once(out, 20)
    stop_and_check(b)


# ---- options: one home for the command line, the config and the launch argv ----------------
def test_worker_options_round_trip_through_the_command_line():
    import argparse

    from gpu.worker.options import WorkerOptions

    options = WorkerOptions(
        "tcp://10.0.0.5:7711",
        "m",
        batch_items=12,
        batch_tokens=3000,
        prefetch=3,
        drain_s=2.5,
        target_batch_s=0.0,
        batch_timeout_s=0.0,
        engine="simulated",
        engine_options={"tokens_per_s": 2000.0, "threads": 2, "model": "/models/x"},
    )
    parser = argparse.ArgumentParser()
    WorkerOptions.add_arguments(parser)
    again = WorkerOptions.from_args(parser.parse_args(options.argv()))
    assert again == WorkerOptions(**{**options.__dict__, "heartbeat": "tcp://10.0.0.5:7712"})
    assert WorkerOptions.from_args(parser.parse_args(again.argv())) == again


def test_local_worker_options_come_from_the_config(tmp_path):
    from broker import write_config

    from config import load_settings
    from config.stage_settings import worker_settings
    from gpu.worker.options import WorkerOptions

    settings = load_settings(write_config(tmp_path, workers=2))
    options = WorkerOptions.from_settings(worker_settings(settings, 1))
    group = settings.worker_groups[0]
    assert options.broker.startswith("tcp://127.0.0.1:") or options.broker.startswith("ipc://")
    assert (options.batch_items, options.prefetch, options.drain_s) == (
        group.batch_items,
        group.prefetch,
        group.drain_s,
    )
    assert options.model == (group.model or settings.models[0].name)
