"""The front stage driven in-process, one step at a time, on a clock of the test's own.

The front reads no clock: every deadline comes from the `now` its loop passes to
`step(now)`, so a chunk's deadline is tested here by moving the clock, not by waiting.
No other stage runs: the test stands in for the producer (a DEALER on the front's port)
and for the tokenizers (a PULL on the front's tokenize socket).
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from broker import write_config, write_jsonl
from conftest import wait_for

from config import load_settings
from config.stage_settings import stage_settings
from ingest.batch_input import iter_batch_input
from ingest.chunk_wire import chunk_to_wire
from ingest.front_stage import FrontStage
from ingest.inflight import DEADLINE_MARGIN_S
from pipeline.store.datadir import DataDir
from pipeline.transport import wire
from pipeline.transport.topology import internal_address

MT = wire.MessageType
T0 = 1000.0  # the test's clock: far from the host's monotonic clock, so a real read shows


@pytest.fixture
def front(tmp_path):
    settings = load_settings(write_config(tmp_path))
    DataDir(settings.data_path).ensure()
    stage = FrontStage(stage_settings(settings, "front"), 0)
    stage.open()
    context = zmq.Context()
    producer = wire.open_socket(context, zmq.DEALER, connect=settings.ingest.bind)
    tokenizer = wire.open_socket(context, zmq.PULL, connect=internal_address(settings, "tokenize"))
    yield stage, producer, tokenizer
    producer.close(0)
    tokenizer.close(0)
    context.term()
    stage.close()


def text_chunk(tmp_path, settings, job: str) -> tuple[dict, dict[str, np.ndarray]]:
    """SUBMIT_CHUNK of a one-chunk job whose every line is text (so it goes to a tokenizer)."""
    source = tmp_path / "in.jsonl"
    write_jsonl(source, 8, text_every=1)
    chunk = next(iter_batch_input(source, settings, chunk_lines=8))
    meta, arrays = chunk_to_wire(chunk)
    meta.update(job=job, chunk=0, chunk_lines=8, final=True)
    return meta, arrays


def test_a_chunk_past_its_deadline_is_answered_retryably_on_the_front_s_own_clock(tmp_path, front):
    stage, producer, tokenizer = front
    timeout_s = stage.settings.ingest.chunk_timeout_s
    wire.send(producer, MT.SUBMIT_CHUNK, *text_chunk(tmp_path, stage.settings, "clocked"))

    def taken() -> bool:
        stage.step(T0)
        return len(stage.inflight) == 1 and not stage.forwarding.waiting

    wait_for(taken, "the front to accept the chunk and send it to a tokenizer", 10)
    sent = wire.recv(tokenizer, 5000)
    assert sent is not None and sent.type == MT.TOKENIZE
    # the writers' deadline comes from the clock the front was given, not from the host's
    assert sent.meta["deadline_ns"] == round((T0 + timeout_s) * 1e9)

    stage.step(T0 + timeout_s + DEADLINE_MARGIN_S - 0.001)  # no tokenizer ever answers
    assert len(stage.inflight) == 1, "the chunk must still be in flight before its deadline"
    stage.step(T0 + timeout_s + DEADLINE_MARGIN_S + 0.001)
    assert len(stage.inflight) == 0
    answer = wire.recv(producer, 5000)
    assert answer is not None and answer.type == MT.CHUNK_ERROR and answer.retryable
    assert answer.meta["chunk"] == 0 and "timed out" in answer.meta["reason"]
    assert stage.registry.get("clocked").chunks[0].committed is None


def test_a_front_restarted_alone_holds_a_retried_chunk_until_the_first_try_cannot_land(
    tmp_path,
):
    """The front dies with a chunk's first try still behind it (a tokenizer, the router or a
    writer may hold its records until their deadline): the restarted front of the same broker
    life must not check and send the retry before then, or both tries would land. A new broker
    life (every stage and ring new) takes the retry at once."""
    settings = load_settings(write_config(tmp_path))
    DataDir(settings.data_path).ensure()
    timeout_s = settings.ingest.chunk_timeout_s
    meta, arrays = text_chunk(tmp_path, settings, "restarted")
    context = zmq.Context()
    opened: list = []

    def front_life(epoch: int):
        """A front of broker life `epoch`, a producer and a tokenizer connected to it."""
        stage = FrontStage(stage_settings(settings, "front"), 0, epoch)  # as the supervisor does
        stage.open()
        producer = wire.open_socket(context, zmq.DEALER, connect=settings.ingest.bind)
        tokenizer = wire.open_socket(
            context, zmq.PULL, connect=internal_address(settings, "tokenize")
        )
        opened.append((stage, producer, tokenizer))
        return stage, producer, tokenizer

    def dies() -> None:
        stage, producer, tokenizer = opened.pop()
        producer.close(0)
        tokenizer.close(0)
        stage.close()

    def sent_on(stage, now: float) -> bool:
        stage.step(now)
        return bool(stage.inflight) and not stage.forwarding.waiting

    try:
        first, producer, tokenizer = front_life(1)
        wire.send(producer, MT.SUBMIT_CHUNK, meta, arrays)
        wait_for(lambda: sent_on(first, T0), "the first try to be sent on", 10)
        assert wire.recv(tokenizer, 5000).type == MT.TOKENIZE  # never answered
        dies()

        second, producer, tokenizer = front_life(1)  # restarted alone, same broker life
        wire.send(producer, MT.SUBMIT_CHUNK, meta, arrays)
        wait_for(lambda: second.step(T0 + 1) or second.parked, "the retry to be held", 10)
        wire.send(producer, MT.SUBMIT_CHUNK, meta, arrays)  # sent again while it waits
        for now in (T0 + 2, T0 + timeout_s + DEADLINE_MARGIN_S - 0.001):
            second.step(now)
            assert not second.inflight and wire.recv(tokenizer, 50) is None, now
        later = T0 + timeout_s + DEADLINE_MARGIN_S + 0.001  # the first try can no longer land
        wait_for(lambda: sent_on(second, later), "the retry to be sent on", 10)
        assert not second.parked
        retry = wire.recv(tokenizer, 5000)
        assert retry is not None and retry.type == MT.TOKENIZE
        assert retry.meta["deadline_ns"] == round((later + timeout_s) * 1e9)
        dies()

        third, producer, tokenizer = front_life(2)  # a new broker life
        wire.send(producer, MT.SUBMIT_CHUNK, meta, arrays)
        wait_for(lambda: sent_on(third, later + 1), "the retry to be sent on at once", 10)
        assert not third.parked and wire.recv(tokenizer, 5000).type == MT.TOKENIZE
    finally:
        while opened:
            dies()
        context.term()


def test_items_acknowledged_twice_are_stored_once(tmp_path, front):
    """Two acknowledgements of the same items of a chunk (its records appended twice, by two
    consumers of one ring: chaos seed 33071's chaos-0021, whose commits said 482 stored for
    241 lines) count each item once: the commit says the chunk's lines, not twice them, and
    the job's total is one outcome per line."""
    from ingest.error_wire import errors_to_wire

    stage, producer, tokenizer = front
    wire.send(producer, MT.SUBMIT_CHUNK, *text_chunk(tmp_path, stage.settings, "twice"))

    def taken() -> bool:
        stage.step(T0)
        return len(stage.inflight) == 1 and not stage.forwarding.waiting

    wait_for(taken, "the front to accept the chunk and send it to a tokenizer", 10)
    assert wire.recv(tokenizer, 5000).type == MT.TOKENIZE
    job_no = stage.registry.get("twice").job_no
    context = zmq.Context()
    reports = wire.open_socket(
        context, zmq.PUSH, connect=internal_address(stage.settings, "front"), linger_ms=1000
    )
    try:
        index = np.arange(8, dtype=np.uint32)
        for _ in range(2):  # the writer's answer for each copy
            ack = {"job_no": job_no, "chunk": 0, "count": 8}
            wire.send(reports, MT.APPEND_ACK, ack, {"index": index})
        report = {"job_no": job_no, "chunk": 0, "forwarded": 8, "errors": []}
        wire.send(reports, MT.TOKENIZED, report, errors_to_wire([]))

        def committed() -> bool:
            stage.step(T0 + 1)
            return not stage.inflight

        wait_for(committed, "the chunk's commit", 10)
        answer = wire.recv(producer, 5000)
        assert answer is not None and answer.type == MT.CHUNK_ACK, answer
        job = stage.registry.get("twice")
        assert job.chunks[0].committed is not None
        assert job.stored == 8, f"stored {job.stored} for 8 lines"
    finally:
        reports.close(0)
        context.term()
