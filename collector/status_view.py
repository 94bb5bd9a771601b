"""`run.py status` as tables: the broker's queues and workers, or one job's progress."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from pipeline.core.deadline_words import clock, deadline_words
from pipeline.core.job_states import JobState
from pipeline.process.stage_restarts import describe


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def duration(seconds: float | None) -> str:
    """`45s`, `12m`, `1.5h`; `-` when unknown."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _age(created_ns: int) -> str:
    return duration((time.time_ns() - created_ns) / 1e9)


def job_done(job: dict[str, Any]) -> tuple[int, int | None]:
    """(items with a result or an error result, total or None while it is submitted)."""
    return int(job.get("completed") or 0) + int(job.get("failed") or 0), job.get("total")


def job_fields(job: dict[str, Any]) -> tuple[str, str, str, str]:
    """(done/total text, failed, rate, time left) of one JOB_INFO: what `status --watch` shows
    of a job, and `run.py batch` of its own (the rate and time left are completion's)."""
    done, total = job_done(job)
    if total:
        progress = f"{done}/{total} ({100 * done / total:.0f}%)"
    else:
        progress = f"{done}/? (submitting)" if total is None else "0/0"
    eta = job.get("eta_s")
    left = duration(eta) if eta else ("-" if job.get("state") != JobState.COMPLETED else "0s")
    return progress, str(job.get("failed", "-")), f"{job.get('rate', 0):.0f}/s", left


def demand_rows(info: dict[str, Any]) -> list[list[Any]]:
    """Per model with work or workers: workers there and needed, items pending, the oldest's
    wait, one worker's measured rate ("-" until measured), jobs whose deadline is at risk."""
    rows = []
    for model, d in sorted(info.get("demand", {}).items()):
        if not (d["workers"] or d["workers_needed"] or d["items_pending"]):
            continue
        rate = d["worker_items_per_s"]
        rows.append(
            [
                model,
                d["workers"],
                d["workers_needed"],
                d["items_pending"],
                duration(d["oldest_pending_age_s"]),
                "-" if rate is None else f"{rate:.0f}",
                d["jobs_at_risk"],
            ]
        )
    return rows


def render_broker(info: dict[str, Any]) -> str:
    """Queue depth per model and lane, in-flight items, workers and rates."""
    queues: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for q in info["queues"]:
        row = queues[(q["model"], q["lane"])]
        row[0] += q["queued"]
        row[1] += q["queued"] * q["lane"]
        row[2] = min(row[2] or q["created_ns"], q["created_ns"])
    parts = [
        _table(
            ["model", "lane", "queued items", "tokens (at most)", "oldest"],
            [
                [model, lane, items, tokens, _age(oldest)]
                for (model, lane), (items, tokens, oldest) in sorted(queues.items())
            ]
            or [["-", "-", 0, 0, "-"]],
        ),
        "",
        f"in flight: {info['in_flight']} items; handed out {info['handed_out']}, "
        f"retired {info['retired']} since dispatch started; "
        f"rates: in {info.get('rate_in', 0):.0f}/s, out {info.get('rate_out', 0):.0f}/s",
        "",
        _table(
            ["worker session", "model", "batches held", "items done", "items/s", "silent"],
            [
                [
                    w["session"],
                    w["model"],
                    w["batches"],
                    w["retired"],
                    f"{w['retired'] / w['age_s']:.0f}" if w["age_s"] > 0 else "0",
                    f"{w['silent_s']:.1f}s" + (" (stalled)" if w.get("stalled") else ""),
                ]
                for w in info["workers"]
            ]
            or [["(no workers)", "", "", "", "", ""]],
        ),
    ]
    demand = demand_rows(info)
    if demand:  # docs/dispatch.md, "Demand and deadlines"
        parts += [
            "",
            _table(
                [
                    "model",
                    "workers",
                    "needed",
                    "pending",
                    "oldest",
                    "items/s per worker",
                    "at risk",
                ],
                demand,
            ),
        ]
    for stage in info.get("local_workers", ()):
        parts.append(f"local {stage['stage']}: {describe(stage)}")
    for name, what in sorted(info.get("damaged_segments", {}).items()):
        parts.append(f"damaged input segment {name}: {what} (run.py check names what was lost)")
    return "\n".join(parts)


def deadline_line(projection: dict[str, Any]) -> str:
    """ "06:00: on track (projected 04:10)" (pipeline/core/deadline_words.py)."""
    now = time.time()
    return f"{clock(projection['deadline_s'], now)}: {deadline_words(projection, now)}"


def render_job(info: dict[str, Any]) -> str:
    """One job: state, counts, throughput, time left."""
    total = info["total"]
    lines = [
        f"job {info['job']}: {info['state']}"
        + (
            " (paused: queued items wait; `run.py resume` lets them go)"
            if info.get("paused")
            else ""
        ),
        f"  total      {total if total is not None else '(still being submitted)'}",
        f"  completed  {info['completed']}",
        f"  failed     {info['failed']}",
        f"  pending    {info['pending'] if info['pending'] is not None else '-'}"
        + (f" ({info['in_flight']} with workers)" if info.get("in_flight") else ""),
        f"  undelivered results  {info['undelivered']}",
        f"  rate       {info['rate']:.0f} items/s completed",
    ]
    usage = info.get("usage")
    if usage:  # a completion process older than the field sends none
        lines.append(
            f"  tokens     {usage['prompt_tokens']} prompt + {usage['completion_tokens']} "
            f"generated = {usage['total_tokens']}"
        )
    if info.get("priority"):
        lines.append(f"  priority   {info['priority']} (higher first)")
    if info.get("worker_s") is not None:
        lines.append(f"  worker time  {info['worker_s']:.1f} s of engine time (workers' word)")
    limits = info.get("limits") or {}
    if limits:  # the job's caps (pipeline/core/job_limits.py); the budget's share used
        budget = limits.get("max_tokens")
        used = (
            f" ({100 * usage['total_tokens'] / budget:.0f}% of the token budget)"
            if (budget and usage)
            else ""
        )
        lines.append(f"  limits     {', '.join(f'{k} {v}' for k, v in limits.items())}{used}")
    if info.get("stopped"):
        stop = info["stopped"]
        lines.append(f"  stopped    {stop['code']} ({stop['limit']}): {stop['message']}")
    if info.get("reused") is not None:  # `submit --reuse` (docs/completion.md, Result reuse)
        lines.append(f"  reused     {info['reused']} lines took an identical earlier result")
    for model, why in (info.get("reuse_off") or {}).items():  # no model fingerprint
        lines.append(f"  reuse off  model {model}: its lines never reuse ({why})")
    if info.get("fanout"):
        fan = info["fanout"]
        lines.append(f"  parts      {fan['parts']} in {fan['lines']} lines of several parts")
    if info.get("deliver", "file") != "file":
        lines.append(f"  delivered to  {info['deliver']} (python run.py vectors stats)")
    if info.get("eta_s"):
        lines.append(f"  time left  about {info['eta_s']:.0f} s")
    if info.get("deadline"):
        lines.append(f"  deadline   {deadline_line(info['deadline'])}")
    hook = info.get("webhook")
    if hook:  # docs/operations.md, Webhooks
        tries = f"{hook['attempts']} attempt{'s' if hook['attempts'] != 1 else ''}"
        error = f"; last error: {hook['last_error']}" if hook.get("last_error") else ""
        lines.append(f"  webhook    {hook['status']} to {hook['url']} ({tries}{error})")
    return "\n".join(lines)
