"""The chaos run, short: a real broker under random SIGKILLs for ~45 s, every outcome checked.

`bench/chaos.py` is the long version (30 minutes and more, docs/RELIABILITY.md).
This runs the same program (as a process: tests do not import the top floor):
stages, remote workers, the whole broker, submit and results clients are
SIGKILLed (and workers SIGSTOPped past their lease) at random while jobs with
broken lines, over-long text and a poison item go through, a lying worker
sends damaged results, and every time the whole broker is killed one input
segment is damaged (cut mid-slot or a header byte flipped) before it starts
again; then every input line must have exactly one outcome, no custom_id
twice, the counters must equal the files, `run.py check` must be clean and
every input segment collected. At least one whole-broker kill happens within
the first half of the run (`--broker-kill-by`), so a damaged segment is always
among the faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from broker import REPO

RUN_S = 45.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_loses_and_doubles_nothing(tmp_path):
    out = tmp_path / "report.json"
    args = ["--minutes", str(RUN_S / 60), "--seed", "11", "--items", "400", "--jobs", "2"]
    args += ["--damage", "1.0", "--broker-kill-by", str(RUN_S / 2)]
    args += ["--quick", "--root", str(tmp_path / "chaos")]
    # Its own session: a run that overstays is killed with every process it started (a broker,
    # workers, clients), instead of leaving them to run on beside the rest of the suite.
    run = subprocess.Popen(
        [sys.executable, "-m", "bench.chaos", *args, "--report-json", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = run.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        _, stderr = run.communicate()
        raise AssertionError(f"the chaos run did not end within 280 s: {stderr[-3000:]}") from None
    assert out.exists(), f"exit {run.returncode}: {stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["ok"], "\n".join(report["problems"])
    assert run.returncode == 0, stderr[-3000:]
    assert report["jobs"] >= 2
    assert report["lost"] == 0 and report["doubled"] == 0
    assert report["total_kills"] >= 15, report["kills"]
    kinds = {kind.split()[0] for kind in report["kills"]}
    assert "stage" in kinds
    assert sum(report["damage"].values()) >= 1, json.dumps(
        report["kills"]
    )  # a broker kill damaged one
    assert report["liar_runs"] >= 1
