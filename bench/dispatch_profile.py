"""py-spy profiles of dispatch, completion and workers, rendered for the docs.

The sampling and the reading are bench/ingest_profile.py's (`profile`,
`read_raw`, `Profile`); this renders them without the frames every sample
sits under (the stage loop, `Worker.run`), so the inclusive table starts at
the functions that do the work.
"""

from __future__ import annotations

from bench.ingest_profile import RATE, Profile

LINES = 8
LOOP_SHARE = 0.9  # a function under this share of a process's working samples is its loop
LOOPS = (  # the loops every sample of a stage or worker sits under
    ":run_stage",
    ":stage_main",
    ":run_worker",
    ":Worker.run",
    ":Worker.step",
    ":Worker._engine_loop",
    ":WorkerStage.step",
    ":DispatchStage.step",
    ":CompletionStage.step",
)


def render(profiles: list[Profile], items_per_s: float, what: str) -> list[str]:
    lines = [
        f"Throughput while profiled: {items_per_s:,.0f} items/s ({what}; py-spy stops each "
        f"process {RATE} times a second to sample it). Shares are of wall time, summed over a "
        "process's threads (so working + waiting can pass 100%); samples in zmq polls and "
        "thread waits count as waiting; a thread that is runnable but has no core counts as "
        "working, so on two oversubscribed cores these shares overstate CPU (see the CPU "
        "rows for that).",
        "",
    ]
    for p in profiles:
        inner = [
            (s, name)
            for s, name in p.by_function(3 * LINES)
            if s < LOOP_SHARE * p.busy and not name.endswith(LOOPS)
        ]
        lines += [
            f"**{p.label}**: working {100 * p.busy:.0f}% of the time, waiting in polls "
            f"{100 * p.waiting:.0f}%.",
            "",
            "| wall time | line (time in a library: the call, <- the project line making it) |",
            "|---|---|",
            *[f"| {100 * share:.1f}% | `{line}` |" for share, line in p.top(LINES)],
            "",
            "| wall time | under project function (loops left out) |",
            "|---|---|",
            *[f"| {100 * share:.1f}% | `{name}` |" for share, name in inner[:LINES]],
            "",
        ]
    return lines
