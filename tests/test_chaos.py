"""The chaos run, short: a real broker under random SIGKILLs for ~45 s, every outcome checked.

`bench/chaos.py` is the long version (30 minutes and more, docs/RELIABILITY.md).
This runs the same code: stages, remote workers, the whole broker, submit and
results clients are SIGKILLed (and workers SIGSTOPped past their lease) at
random while jobs with broken lines, over-long text and a poison item go
through, a lying worker sends damaged results, and every time the whole broker
is killed one input segment is damaged (cut mid-slot or a header byte
flipped) before it starts again; then every input line must have exactly one outcome, no custom_id
twice, the counters must equal the files, `run.py check` must be clean and
every input segment collected.
"""

from __future__ import annotations

from bench.chaos import Chaos


def test_chaos_loses_and_doubles_nothing(tmp_path):
    chaos = Chaos(tmp_path, seed=11, items=400, jobs=2, damage=1.0)
    report = chaos.run(45.0)
    assert report.ok, "\n".join(report.problems)
    assert report.jobs >= 2
    assert report.lost == 0 and report.doubled == 0
    assert report.total_kills >= 15, report.kills
    kinds = {kind.split()[0] for kind in report.kills}
    assert "stage" in kinds
    assert sum(report.damage.values()) >= 1, report.kills  # a whole-broker kill damaged a file
    assert report.liar_runs >= 1
