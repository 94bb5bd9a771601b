"""Chaos: a whole broker under random kills for as long as asked, every outcome checked at the end.

    .venv/bin/python -m bench.chaos --minutes 30 [--seed 1] [--items 2000] [--jobs 2]
        [--damage P] [--power-cuts] [--root DIR] [--report-json FILE] [--quick]

(tests/test_chaos.py runs it for 45 s, with `--report-json`, and checks the report.)

It starts a broker (bench/chaos_fleet.py: 2 local echo workers), two
`run.py worker` processes (echo and texty) and a lying echo worker
(tests/procs/lying_worker.py: the real worker whose results are damaged per
item, which completion must refuse), and keeps `--jobs` jobs going: each is submitted
with `run.py submit --job-id` (token ids and text, broken lines, text too
long for its model, and one poison item that SIGKILLs any worker that runs
it) and fetched with `run.py results --follow`. Until the time is up, every
0.2-1.5 s it does one of: SIGKILL a stage of the broker (any: front,
tokenizer, router, writer, dispatch, completion, vectors, a local worker),
SIGKILL a remote worker, SIGKILL the whole broker and start it again (half
the time damaging one input segment first: cut mid-slot, or a header byte
flipped; lost items must end as `corrupt_input` error lines),
SIGKILL a results client or a submit and run it again, or SIGSTOP a worker
for longer than its lease and let it go later. A client that fails (the
broker was down too long) is run again with the same arguments, as a user
would.

With `--power-cuts` (bench/chaos_power.py) the data dir and the results
clients' output files are on power-cut disks, and 30% of the actions cut
the power instead: of the broker's machine (every stage and what was not
fsynced go; the broker starts on the rest, torn writes and all) or of the
results clients' (they run again on what they fsynced). The summary then goes
to its own section of docs/RELIABILITY.md.

At the end it stops killing, lets every job finish and be fetched, and
asserts for every job: each input line has exactly one outcome (an output
line or an error line) across its output and error files, no custom_id
twice, the poison item is an error, the job's counters equal the files; then
the broker stops cleanly (exit 0), `python run.py check` is clean and every
input segment is collected. A job not finished 600 s after the kills stopped
is a failure that names what dispatch still holds (segment, slots, session,
from its `status` answer). It prints the kills of each kind survived and the
longest a job had work pending after the kills stopped and, unless
`--quick`, writes the summary to docs/RELIABILITY.md. With power cuts the
broker's logs go to ROOT/broker-log, off the power-cut disk, so that every
life's log outlives the cuts.

This module is the command line; the run is bench/chaos_run.py, the checks at
the end bench/chaos_verify.py, the report and its table bench/chaos_report.py,
the processes bench/chaos_fleet.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import machine
from bench.chaos_fleet import REPO
from bench.chaos_power import PowerCuts
from bench.chaos_report import Report, summary
from bench.chaos_run import DAMAGE_CHANCE, POWER_CUT_CHANCE, Chaos
from bench.report import write_section

DOC = REPO / "docs" / "RELIABILITY.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--items", type=int, default=2000, help="lines per job")
    parser.add_argument("--jobs", type=int, default=2, help="jobs in flight at once")
    parser.add_argument("--quick", action="store_true", help="do not write docs/RELIABILITY.md")
    parser.add_argument(
        "--damage",
        type=float,
        default=DAMAGE_CHANCE,
        help="chance that a whole-broker kill damages one input segment",
    )
    parser.add_argument(
        "--broker-kill-by",
        type=float,
        metavar="S",
        help="kill the whole broker at least once, at the latest S seconds into the run",
    )
    parser.add_argument(
        "--power-cuts",
        action="store_true",
        help="the data dir and the results' files on power-cut disks (bench/chaos_power.py);"
        f" {POWER_CUT_CHANCE * 100:.0f}%% of the actions cut the power instead of a kill",
    )
    parser.add_argument("--root", type=Path, help="a new directory for the run (else var/)")
    parser.add_argument("--report-json", type=Path, help="also write the report here, as JSON")
    args = parser.parse_args()
    root = args.root or REPO / "var" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    facts = machine.describe(root)

    def progress(report: Report, elapsed: float, finished: int) -> None:
        print(
            f"chaos: {elapsed / 60:.1f} min, {report.total_kills} kills, "
            f"{sum(report.power_cuts.values())} power cuts, {finished} jobs done",
            file=sys.stderr,
            flush=True,
        )

    power = PowerCuts(root, args.seed) if args.power_cuts else None
    try:
        chaos = Chaos(
            root,
            args.seed,
            args.items,
            args.jobs,
            damage=args.damage,
            broker_kill_by_s=args.broker_kill_by,
            power=power,
        )
        report = chaos.run(args.minutes * 60, progress)
    finally:
        if power is not None:
            power.close()
    if args.report_json is not None:
        args.report_json.write_text(json.dumps(report.as_json(), indent=1))
    text = summary(report, machine.command_line(), facts)
    print(text)
    if not args.quick:
        write_section(DOC, "chaos-power" if args.power_cuts else "chaos", text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
