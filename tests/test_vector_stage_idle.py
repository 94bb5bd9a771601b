"""A VectorStage with nothing to deliver waits for messages until its next look for jobs."""

from __future__ import annotations

import pytest
from broker import write_config

from collector.vectors.vector_stage import DISCOVER_S, VectorStage
from config import load_settings
from config.stage_settings import stage_settings


@pytest.fixture
def stage(tmp_path):
    stage = VectorStage(stage_settings(load_settings(write_config(tmp_path)), "vectors"), 0)
    stage.open()
    waits = []
    stage.poller.poll = lambda timeout=None: waits.append(timeout) or []
    yield stage, waits
    stage.close()


def test_an_idle_vector_stage_waits_until_its_next_look_for_jobs(stage):
    """No vectors job: it woke every 10 ms (0.6-0.9 CPU s per 1,000 items of an embeddings
    run on 2 cores, taken from the engine); now once per look for jobs, a user's request
    still ending the wait at once (the poller watches the users' socket)."""
    stage, waits = stage
    now = 1000.0
    stage.next_discover, stage.next_flush = now + DISCOVER_S, now + 0.1
    stage.step(now)
    assert waits[-1] >= 0.9 * DISCOVER_S * 1000, waits
    stage.stores.pending = lambda: True  # rows to flush: the flush timer bounds the wait again
    stage.step(now)
    assert waits[-1] <= stage.poll_ms, waits
