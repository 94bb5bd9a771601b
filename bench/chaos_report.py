"""What a chaos run did and found (`Report`), and the result table it prints (`summary`).

bench/chaos_run.py fills a `Report` as it kills and checks; `summary` is the section
bench/chaos.py prints and writes to docs/RELIABILITY.md; `Report.as_json` is what
`--report-json` writes (tests/test_chaos.py reads it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Report:
    seconds: float = 0.0
    kills: Counter = field(default_factory=Counter)
    jobs: int = 0
    lines: int = 0
    lost: int = 0
    doubled: int = 0
    counter_mismatches: int = 0
    problems: list[str] = field(default_factory=list)
    submit_runs: int = 0
    fetch_runs: int = 0
    poison_deaths: int = 0
    settle_s: float = 0.0  # the longest a job had work pending after the kills stopped
    damage: Counter = field(default_factory=Counter)  # input segments damaged while it was down
    liar_runs: int = 0  # runs of the lying worker (it is restarted like the others)
    power_cuts: Counter = field(default_factory=Counter)  # --power-cuts: of which machine

    @property
    def total_kills(self) -> int:
        return sum(n for kind, n in self.kills.items() if kind != "SIGSTOP worker")

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.counter_mismatches or self.problems)

    def as_json(self) -> dict:
        """Every field, and `ok` and `total_kills`: what `--report-json` writes."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**fields, "ok": self.ok, "total_kills": self.total_kills}


def summary(report: Report, command: str, facts: dict) -> str:
    kinds = sorted(report.kills.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [
        "## Power-cut chaos run (bench/chaos.py --power-cuts)"
        if report.power_cuts
        else "## Chaos run (bench/chaos.py)",
        "",
        f"Command: `{command}` ({report.seconds / 60:.1f} min)",
        "",
        *[f"* {name}: {value}" for name, value in facts.items()],
        "",
        "| what | count |",
        "|---|---|",
        *[
            f"| SIGSTOPped past the lease, then resumed: worker | {n:,} |"
            if kind == "SIGSTOP worker"
            else f"| killed: {kind} | {n:,} |"
            for kind, n in kinds
        ],
        f"| kills in all (SIGSTOPs not counted) | {report.total_kills:,} |",
        *[f"| power cut: {kind} | {n:,} |" for kind, n in sorted(report.power_cuts.items())],
        *([f"| power cuts | {sum(report.power_cuts.values()):,} |"] if report.power_cuts else []),
        *[
            f"| damaged while the broker was down: {kind} | {n:,} |"
            for kind, n in report.damage.items()
        ],
        f"| runs of a lying worker (damaged results, refused by completion) | {report.liar_runs:,} |",
        f"| remote workers killed by the poison item and restarted | {report.poison_deaths:,} |",
        f"| jobs | {report.jobs:,} |",
        f"| input lines | {report.lines:,} |",
        f"| submit runs (a killed or failed submit is run again) | {report.submit_runs:,} |",
        f"| results runs (likewise) | {report.fetch_runs:,} |",
        f"| lines lost | {report.lost:,} |",
        f"| lines with two outcomes | {report.doubled:,} |",
        f"| jobs whose counters disagree with their files | {report.counter_mismatches:,} |",
        f"| longest a job had work pending after the kills stopped | {report.settle_s:.1f} s |",
        "",
        "Result: "
        + (
            "**held**: zero lost or doubled outcomes, check clean, segments collected."
            if report.ok
            else "**FAILED**:"
        ),
        *[f"* {p}" for p in report.problems[:20]],
    ]
    return "\n".join(lines)
