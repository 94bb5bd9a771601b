"""Worker-seconds per job (collector/completion/worker_time.py): bounded, durable, written
at most each second."""

from __future__ import annotations

import logging
import math

import pytest

from collector.completion.worker_time import WorkerTime, engine_seconds
from pipeline.store.job_files import JobFiles


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(1.5, 1.5), (0, 0.0), (-1, 0.0), (math.nan, 0.0), (1e9, 0.0), ("2", 0.0), (True, 0.0)],
)
def test_a_workers_engine_time_is_believed_only_in_bounds(value, seconds):
    assert engine_seconds({"engine_s": value}) == seconds
    assert engine_seconds({}) == 0.0


def test_totals_are_written_each_second_and_read_back(tmp_path):
    files = JobFiles(tmp_path)
    files.directory("j").mkdir(parents=True)
    time = WorkerTime(files, logging.getLogger("test"))
    time.add("j", 0.25)
    time.write(now=10.0)
    time.add("j", 0.5)
    time.write(now=10.5)  # within the second: not written yet
    assert files.read_worker_seconds("j") == 0.25
    time.write(now=11.0)
    assert files.read_worker_seconds("j") == 0.75
    again = WorkerTime(files, logging.getLogger("test"))  # a restarted completion
    again.add("j", 0.25)
    assert again.of("j") == 1.0
