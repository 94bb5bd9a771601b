"""`run.py status --watch`: the broker on one screen, redrawn every `interval_s`.

On a terminal the screen is drawn with rich on the alternate screen (so it
works over SSH and leaves the scrollback as it was); when stdout is not a
terminal, or with `--plain`, each refresh prints one block of plain lines,
one fact a line, with no escape codes:

| line prefix    | what                                                           |
|----------------|----------------------------------------------------------------|
| `== status`    | when, the dispatch address, the broker's epoch                 |
| `broker`       | in flight, rates in and out, dead-lettered and corrupt items   |
| `lane`         | one per model and lane with queued work: items, tokens at most, age of the oldest segment |
| `worker`       | one per session: model, batches held, items done, items/s, idle share, silence |
| `demand`       | one per model with work or workers: workers there and needed, items pending, oldest wait, one worker's items/s, jobs at risk |
| `job`          | one per job shown: state, done/total and percent, failed, rate, time left |
| `deadline`     | one per job shown with a deadline: when, on track or at risk (dispatch's projection) |
| `restart`      | one per recent stage death in the supervisor's log             |
| `dead-letter`  | one per recent dead-letter event: job, items, reason            |
| `note`         | what could not be read (the broker down, no data dir here)      |

What each part is computed from is in collector/status_sources.py. SIGINT
(Ctrl-C) and SIGTERM only set a flag; the loop ends at the next refresh and
the command exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from typing import Any, TextIO

from collector.status_sources import Snapshot, Sources
from collector.status_view import deadline_line, demand_rows, duration, job_done, job_fields
from pipeline.core import exitcodes
from pipeline.process.stage import StopFlags
from pipeline.process.stage_restarts import describe

PAUSE_SLICE_S = 0.05  # how often the wait between refreshes looks at the stop flag


def _clock(ns: int) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(ns / 1e9))


def lane_rows(info: dict[str, Any], now_ns: int) -> list[tuple[str, int, int, int, float]]:
    """(model, lane, queued items, tokens at most, oldest age in s), summed over segments."""
    lanes: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for q in info.get("queues", []):
        row = lanes[(q["model"], q["lane"])]
        row[0] += q["queued"]
        row[1] = min(row[1] or q["created_ns"], q["created_ns"])
    return [
        (model, lane, queued, queued * lane, (now_ns - oldest) / 1e9)
        for (model, lane), (queued, oldest) in sorted(lanes.items())
    ]


def worker_rows(info: dict[str, Any]) -> list[tuple[str, str, int, int, float, float, float]]:
    """(session, model, batches, items done, items/s, idle fraction, silent s) per session."""
    return [
        (
            w["session"],
            w["model"] or "?",
            w["batches"],
            w["retired"],
            w["retired"] / w["age_s"] if w["age_s"] > 0 else 0.0,
            float(w.get("idle_fraction", 0.0)),
            w["silent_s"],
        )
        for w in info.get("workers", [])
    ]


def _dead_letter_text(event: dict[str, Any], names: dict[int, str]) -> str:
    job = names.get(event["job_no"], f"#{event['job_no']}")
    segments = ", ".join(str(s) for s in event["segments"][:5])
    return f"job {job}: {event['items']} item(s) {event['reason']} (segment {segments})"


# ---- plain --------------------------------------------------------------------------------
def plain_lines(snap: Snapshot, address: str) -> list[str]:
    """One refresh as plain lines (see the module docstring)."""
    info = snap.broker
    epoch = f" epoch {info['epoch']}" if info else ""
    lines = [f"== status {_clock(snap.taken_ns)} dispatch {address}{epoch}"]
    if info is None:
        lines.append(f"note {snap.broker_error}")
    else:
        lines.append(
            f"broker in_flight={info['in_flight']} rate_in={info.get('rate_in', 0):.0f}/s "
            f"rate_out={info.get('rate_out', 0):.0f}/s "
            f"dead_lettered={info.get('dead_lettered', 0)} corrupt={info.get('corrupt', 0)}"
        )
        for name, what in sorted(info.get("damaged_segments", {}).items()):
            lines.append(f"damaged {name}: {what} (run.py check names what was lost)")
        rows = lane_rows(info, snap.taken_ns)
        for model, lane, queued, tokens, oldest in rows:
            lines.append(
                f"lane {model}/{lane} queued={queued} tokens<={tokens} oldest={duration(oldest)}"
            )
        if not rows:
            lines.append("lane (no queued work)")
        workers = worker_rows(info)
        for session, model, batches, done, rate, idle, silent in workers:
            lines.append(
                f"worker {session} model={model} batches={batches} done={done} "
                f"rate={rate:.0f}/s idle={100 * idle:.0f}% silent={silent:.1f}s"
            )
        if not workers:
            lines.append("worker (no workers)")
        for model, there, needed, pending, oldest, rate, at_risk in demand_rows(info):
            lines.append(
                f"demand {model} workers={there} needed={needed} pending={pending} "
                f"oldest={oldest} per_worker={rate}/s at_risk={at_risk}"
            )
        for stage in info.get("local_workers", ()):
            lines.append(f"worker {stage['stage']} (local) {describe(stage)}")
    for job in snap.jobs:
        if "note" in job:  # completion could not say (an unknown job)
            lines.append(f"job {job['job']} {job['state']}: {job['note']}")
            continue
        progress, failed, rate, left = job_fields(job)
        lines.append(
            f"job {job['job']} {job['state']} {progress} failed={failed} rate={rate} left={left}"
        )
        if job.get("deadline"):
            lines.append(f"deadline {job['job']} {deadline_line(job['deadline'])}")
    if snap.jobs_hidden:
        lines.append(f"job (+{snap.jobs_hidden} more)")
    for restart in snap.restarts:
        lines.append(f"restart {_clock(restart.at_ns)} {restart.text}")
    for event in (info or {}).get("dead_letters", [])[-5:]:
        lines.append(
            f"dead-letter {_clock(event['ns'])} {_dead_letter_text(event, snap.job_names)}"
        )
    lines += [f"note {n}" for n in (snap.jobs_note, snap.restarts_note) if n]
    return lines


# ---- rich ---------------------------------------------------------------------------------
def rich_view(snap: Snapshot, address: str):
    """One refresh as a rich renderable."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    def table(title: str, *columns: str, left: int = 2) -> Table:
        """A table whose first `left` columns are text (left-aligned), the rest numbers."""
        t = Table(title=title, title_justify="left", title_style="bold", expand=False)
        for i, column in enumerate(columns):
            t.add_column(column, justify="left" if i < left else "right", no_wrap=True)
        return t

    info = snap.broker
    parts: list[Any] = []
    head = Text(f"Inference Fabric  {_clock(snap.taken_ns)}  dispatch {address}", style="bold")
    if info is not None:
        head.append(
            f"   in flight {info['in_flight']}   in {info.get('rate_in', 0):.0f}/s"
            f"   out {info.get('rate_out', 0):.0f}/s   dead-lettered {info.get('dead_lettered', 0)}"
            f"   corrupt {info.get('corrupt', 0)}",
            style="none",
        )
    parts.append(head)
    if info is None:
        parts.append(Text(snap.broker_error or "", style="bold red"))
    else:
        lanes = table("Lanes", "model", "lane", "queued", "tokens (at most)", "oldest")
        for model, lane, queued, tokens, oldest in lane_rows(info, snap.taken_ns):
            lanes.add_row(model, str(lane), str(queued), str(tokens), duration(oldest))
        if not lanes.row_count:
            lanes.add_row("(no queued work)", "", "", "", "")
        workers = table(
            "Workers", "session", "model", "batches", "done", "items/s", "idle", "silent"
        )
        for session, model, batches, done, rate, idle, silent in worker_rows(info):
            workers.add_row(
                session,
                model,
                str(batches),
                str(done),
                f"{rate:.0f}",
                Text(f"{100 * idle:.0f}%", style="yellow" if idle > 0.5 else ""),
                f"{silent:.1f}s",
            )
        for stage in info.get("local_workers", ()):
            if stage["state"] == "restarting":
                workers.add_row(
                    f"{stage['stage']} (local)", Text(describe(stage), style="red"), *[""] * 5
                )
        if not workers.row_count:
            workers.add_row("(no workers)", "", "", "", "", "", "")
        demand = table(
            "Demand", "model", "workers", "needed", "pending", "oldest", "items/s per worker",
            "at risk", left=1,
        )  # fmt: skip
        for row in demand_rows(info):
            demand.add_row(*(str(cell) for cell in row))
        parts += [lanes, workers] + ([demand] if demand.row_count else [])
    if snap.jobs or snap.jobs_note is None:
        jobs = table(
            "Jobs", "job", "state", "progress", "done", "failed", "rate", "time left", left=3
        )
        jobs.add_column("deadline", justify="left", no_wrap=True)
        for job in snap.jobs:
            if "note" in job:
                jobs.add_row(job["job"], job["state"], Text(job["note"], style="red"))
                continue
            done, total = job_done(job)
            progress, failed, rate, left = job_fields(job)
            bar = ProgressBar(total=float(total or 1), completed=float(done if total else 0))
            bar.width = 24
            due = job.get("deadline")
            at_risk = bool(due and due.get("at_risk"))
            deadline = Text(deadline_line(due) if due else "", style="red" if at_risk else "")
            jobs.add_row(job["job"], job["state"], bar, progress, failed, rate, left, deadline)
        if not jobs.row_count:
            jobs.add_row("(no recent jobs)", "", "", "", "", "", "", "")
        if snap.jobs_hidden:
            jobs.caption = f"+{snap.jobs_hidden} more"
        parts.append(jobs)
    if snap.restarts:
        restarts = table("Recent restarts", "when", "stage", "what", left=3)
        for r in reversed(snap.restarts):
            restarts.add_row(_clock(r.at_ns), r.stage, r.text)
        parts.append(restarts)
    events = (info or {}).get("dead_letters", [])
    if events:
        letters = table("Dead letters", "when", "what", left=2)
        for event in reversed(events[-5:]):
            letters.add_row(_clock(event["ns"]), _dead_letter_text(event, snap.job_names))
        parts.append(letters)
    for note in (snap.jobs_note, snap.restarts_note):
        if note:
            parts.append(Text(note, style="dim"))
    parts.append(Text("Ctrl-C to quit", style="dim"))
    return Group(*parts)


# ---- the loop -----------------------------------------------------------------------------
def _pause(flags: StopFlags, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not flags.stop and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(PAUSE_SLICE_S, left))


def watch(
    sources: Sources,
    address: str,
    interval_s: float = 1.0,
    plain: bool = False,
    out: TextIO | None = None,
) -> int:
    """Refresh until SIGINT or SIGTERM; returns exit code 0."""
    out = sys.stdout if out is None else out
    flags = StopFlags()
    try:
        if plain:
            while not flags.stop:
                started = time.monotonic()
                lines = plain_lines(sources.snapshot(), address)
                print("\n".join(lines), end="\n\n", file=out, flush=True)
                _pause(flags, interval_s - (time.monotonic() - started))
            return exitcodes.OK
        from rich.console import Console
        from rich.live import Live

        console = Console(file=out)
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while not flags.stop:
                started = time.monotonic()
                live.update(rich_view(sources.snapshot(), address), refresh=True)
                _pause(flags, interval_s - (time.monotonic() - started))
        return exitcodes.OK
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())  # so the flush at exit does not fail again
        os.close(devnull)
        return exitcodes.OK
    finally:
        sources.close()
