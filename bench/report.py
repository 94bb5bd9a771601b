"""Result rows, the markdown table they print as, and each benchmark's section of the docs.

A benchmark owns one section of docs/BENCHMARKS.md, between the markers
`<!-- begin NAME -->` and `<!-- end NAME -->`; rewriting it leaves every
other section as it was.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

INTRO = """# Benchmarks

Each benchmark is one command under `bench/`. It runs
on the machine it is given, prints a table (median and spread over repeats,
the command line, the machine) and rewrites its own section below, so every
number here was measured in one run, on the machine it names. Benchmarks are
never run as tests.
"""


@dataclass(frozen=True)
class Row:
    """One measured quantity: every repeat's value, and the target it is held to."""

    step: str
    measure: str
    values: tuple[float, ...]
    percent: bool = False
    target: str = ""
    at_least: float | None = None  # the target, on the median times `per_target`
    below: float | None = None
    per_target: float = 1.0  # scales the median to the target's terms (e.g. to 5 M items)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def met(self) -> bool | None:
        """Whether the median meets the target; None when there is none."""
        value = self.median * self.per_target
        if self.at_least is not None:
            return value >= self.at_least
        if self.below is not None:
            return value < self.below
        return None

    def cells(self) -> list[str]:
        spread = (
            f"{_number(min(self.values), self.percent)} – {_number(max(self.values), self.percent)}"
            if len(self.values) > 1
            else ""
        )
        met = {None: "", True: "yes", False: "**no**"}[self.met]
        return [
            self.step,
            self.measure,
            _number(self.median, self.percent),
            spread,
            str(len(self.values)),
            self.target,
            met,
        ]


def _number(value: float, percent: bool = False) -> str:
    if percent:
        return f"{100 * value:.0f}%"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def markdown_table(rows: list[Row]) -> str:
    head = ["step", "measure", "median", "spread (min – max)", "n", "target", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def write_section(doc: Path, name: str, body: str) -> None:
    """Replace the text between this benchmark's markers (append it the first time)."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = doc.read_text() if doc.exists() else INTRO
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def render_section(
    title: str,
    intro: str,
    command: str,
    seconds: float,
    facts: dict[str, str],
    rows: list[Row],
    notes: list[str],
    checks: list[tuple[str, bool]] = (),
    tail: list[str] = (),
) -> str:
    """A benchmark's section of docs/BENCHMARKS.md, which is also what its command prints:
    title, what it measures, the command, the machine, the table, each target and check
    met or missed, the method notes, then anything in `tail`."""
    judged = [row for row in rows if row.met is not None]
    met = sum(row.met for row in judged) + sum(ok for _, ok in checks)
    label = "Targets and checks" if checks else "Targets"
    lines = [
        f"## {title}",
        "",
        intro,
        "",
        f"Command: `{command}` ({seconds:.0f} s)",
        "",
        *[f"* {name}: {value}" for name, value in facts.items()],
        "",
        markdown_table(rows),
        "",
        f"{label}: {met} of {len(judged) + len(checks)} met.",
        "",
        *[
            f"* {row.step}, {row.measure}: {row.cells()[2]} against {row.target}: "
            f"{'met' if row.met else '**missed**'}"
            for row in judged
        ],
        *[f"* {text}: {'ok' if ok else '**failed**'}" for text, ok in checks],
        "",
        "Method:",
        "",
        *[f"* {note}" for note in notes],
        *tail,
    ]
    return "\n".join(lines).rstrip() + "\n"
