"""`run.py status` tables: queues summed per model and lane, workers with rates, one job."""

from __future__ import annotations

import time

from collector.status_view import render_broker, render_job


def test_broker_table_sums_segments_per_model_and_lane_and_lists_workers():
    now = time.time_ns()
    info = {
        "queues": [
            {"model": "m", "lane": 64, "queued": 10, "created_ns": now - 90 * 10**9},
            {"model": "m", "lane": 64, "queued": 5, "created_ns": now - 10 * 10**9},
            {"model": "m", "lane": 128, "queued": 2, "created_ns": now},
        ],
        "in_flight": 7,
        "handed_out": 100,
        "retired": 93,
        "rate_in": 12.0,
        "rate_out": 11.0,
        "workers": [
            {
                "session": "abc",
                "model": "m",
                "batches": 2,
                "retired": 50,
                "age_s": 10.0,
                "silent_s": 0.2,
            }
        ],
    }
    text = render_broker(info)
    rows = {tuple(line.split()[:4]) for line in text.splitlines()}
    assert ("m", "64", "15", str(15 * 64)) in rows  # two segments of one lane, summed
    assert ("m", "128", "2", "256") in rows
    assert "90s" in text  # the oldest item's age in that lane
    assert "in flight: 7 items" in text and "out 11/s" in text
    assert any(line.split()[:5] == ["abc", "m", "2", "50", "5"] for line in text.splitlines())
    empty = render_broker({**info, "queues": [], "workers": []})
    assert "(no workers)" in empty
    restarting = {
        "stage": "worker-0",
        "state": "restarting",
        "deaths_in_a_row": 4,
        "deaths": 4,
        "last_exit": "signal SIGKILL",
        "last_error": None,
        "restart_in_s": 7.6,
    }
    crashing = render_broker({**info, "workers": [], "local_workers": [restarting]})
    assert "(no workers)" in crashing  # and why:
    assert "local worker-0: restarting in 8s after 4 deaths in a row: signal SIGKILL" in crashing


def test_job_view_says_state_counts_and_time_left():
    info = {
        "job": "j",
        "state": "in_progress",
        "total": 100,
        "completed": 40,
        "failed": 10,
        "pending": 50,
        "undelivered": 3,
        "rate": 5.0,
        "eta_s": 10.0,
    }
    text = render_job(info)
    assert text.splitlines()[0] == "job j: in_progress"
    assert "pending    50" in text and "about 10 s" in text
    assert "(still being submitted)" in render_job({**info, "total": None, "pending": None})
