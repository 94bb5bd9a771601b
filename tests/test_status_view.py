"""`run.py status` tables: queues summed per model and lane, workers with rates, one job."""

from __future__ import annotations

import time

from collector.status_sources import Snapshot
from collector.status_view import render_broker, render_job
from collector.status_watch import plain_lines


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


def test_the_broker_table_shows_the_demand_and_a_job_its_deadline_answer():
    row = {
        "workers_needed": 3,
        "items_pending": 1080,
        "tokens_pending": 69120,
        "oldest_pending_age_s": 4.2,
        "worker_items_per_s": 20.0,
        "worker_tokens_per_s": 1280.0,
        "workers": 2,
        "jobs_at_risk": 1,
    }
    idle = {**row, "workers_needed": 0, "items_pending": 0, "workers": 0}
    info = {
        "queues": [],
        "in_flight": 0,
        "handed_out": 0,
        "retired": 0,
        "workers": [],
        "demand": {"echo": row, "idle": idle},
    }
    lines = [line.split() for line in render_broker(info).splitlines()]
    assert ["echo", "2", "3", "1080", "4s", "20", "1"] in lines
    assert not any(line and line[0] == "idle" for line in lines)  # nothing to say about it
    now = time.time()
    late = {
        "model": "echo",
        "deadline_s": now + 600,
        "projected_finish_s": now + 900,
        "measured": True,
        "at_risk": True,
        "workers": 2,
        "workers_to_finish": 3,
    }
    job = {"job": "j", "state": "in_progress", "total": 10, "completed": 1, "failed": 0}
    text = render_job({**job, "pending": 9, "undelivered": 0, "rate": 1.0, "deadline": late})
    assert "  deadline   " in text and ": at risk (projected " in text
    assert "with 2 workers; 3 would finish by " in text
    shown = {**job, "pending": 9, "undelivered": 0, "rate": 1.0, "deadline": late}
    snap = Snapshot(time.time_ns(), broker={**info, "epoch": 1}, jobs=[shown])
    watched = plain_lines(snap, "addr")
    assert "demand echo workers=2 needed=3 pending=1080 oldest=4s per_worker=20/s at_risk=1" in (
        watched
    )
    assert any(line.startswith("deadline j ") and "at risk (projected" in line for line in watched)
