"""A job's token totals (`usage` in JOB_INFO): every result counted once, rebuilt the same."""

from __future__ import annotations

import logging

import numpy as np
from test_completion_log import inputs, results

from collector.completion.job_status import JobStatus
from collector.completion.results_log import CompletionLog
from collector.completion.worker_time import WorkerTime
from pipeline.core.job_limits import JobLimits
from pipeline.core.line_table import LineTable
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.store.job_files import JobFiles


def with_prompts(batch, prompts):
    batch.prompt_tokens = np.asarray(prompts, np.uint32)
    return batch


def test_token_totals_count_each_result_once_and_survive_a_reload(data_dir):
    segs = inputs(data_dir)
    first = min(segs)
    log = CompletionLog(data_dir, segs.__getitem__)
    picks = [(first, k) for k in range(4)]
    # 4 generated results of 12 bytes (3 tokens each), prompts 5, 6, 7, 8
    log.record(with_prompts(results(segs, picks, size=12), [5, 6, 7, 8]))
    assert log.tokens("job-c") == (26, 12)
    # the same items again (a retry, a resend): nothing counts twice
    log.record(with_prompts(results(segs, picks, size=12), [5, 6, 7, 8]))
    # an embedding (kind VECTOR) counts its prompt only; an error result counts nothing
    vector = ResultStatus.RESULT | (ResultKind.VECTOR << 4)
    log.record(with_prompts(results(segs, [(first, 4)], status=vector, size=16), [9]))
    error = ResultStatus.ERROR | (ResultKind.TEXT << 4)
    log.record(with_prompts(results(segs, [(first, 5)], status=error, size=8), [3]))
    assert log.tokens("job-c") == (35, 12)
    log.close()
    again = CompletionLog(data_dir, segs.__getitem__)  # rebuilt from the completion segments
    assert again.tokens("job-c") == (35, 12)
    assert again.completed("job-c") == 6


def test_job_info_carries_the_usage(data_dir):
    segs = inputs(data_dir)
    log = CompletionLog(data_dir, segs.__getitem__)
    log.record(with_prompts(results(segs, [(min(segs), 0)], size=8), [4]))

    class View:
        job_id, job_no, total, cancelled, created_ns, deliver = "job-c", 7, 10, False, 0, "file"
        lines = LineTable()  # no line of several parts
        paused, current_priority, limits, stopped = False, 0, JobLimits(), None
        reuse, reused_count = False, 0  # a job without `--reuse`

    worker_time = WorkerTime(JobFiles(data_dir.root), logging.getLogger("test"))
    info = JobStatus(log, worker_time).info(View(), False, 0.0)
    assert info["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    log.close()
