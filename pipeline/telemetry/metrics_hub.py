"""The supervisor's view of every stage's statistics: the latest report of each, merged.

`MetricsHub` is fed from two threads: the supervisor's loop says which
stage process runs (`started`, `ended`) and the metrics thread hands it each
STATS report (`update`). `snapshot()` merges them for a scrape:

* series with equal labels from several processes of one stage (writers)
  are added up;
* a report is taken only from the process the supervisor last started
  under that label, so a late report of a dead process changes nothing;
* when a stage process ends, its gauges go and its counters (those with
  `carry`) and histograms are kept as a carried-over base that its next
  life's figures add to: a counter only ever grows within a broker's life,
  whatever restarts (at most `metrics.interval_s` of counts are lost with a
  killed process);
* the supervisor's own figures: restarts, whether each stage is up, and for
  a stage restarted after deaths in a row (a local worker never given up
  on) how many and how long until its next start.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from pipeline.telemetry.metric_catalogue import COUNTER, HISTOGRAM, METRICS

Key = tuple[str, tuple[str, ...]]  # (metric name, label values)


def _add_histogram(into: dict[Key, list], key: Key, value: list) -> None:
    counts, total = value
    have = into.get(key)
    if have is None:
        into[key] = [list(counts), float(total)]
    elif len(have[0]) == len(counts):
        have[0] = [a + b for a, b in zip(have[0], counts, strict=True)]
        have[1] += float(total)


class MetricsHub:
    """Latest statistics per stage process, carried-over counters, restarts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: dict[str, int] = {}  # stage label -> pid of its running process
        self._latest: dict[str, list[list]] = {}  # stage label -> its last samples
        self._carried: dict[Key, float] = defaultdict(float)
        self._carried_histograms: dict[Key, list] = {}
        self._starts: dict[str, int] = defaultdict(int)
        self._up: dict[str, bool] = {}
        self._restart_at: dict[str, float] = {}  # stage label -> monotonic time of next start
        self._in_a_row: dict[str, int] = {}  # stage label -> deaths in a row

    def started(self, label: str, pid: int) -> None:
        """The supervisor started (or restarted) stage `label` as process `pid`."""
        with self._lock:
            self._fold(label)
            self._pids[label] = pid
            self._starts[label] += 1
            self._up[label] = True

    def ended(self, label: str) -> None:
        """Stage `label`'s process is gone (died or stopped)."""
        with self._lock:
            self._fold(label)
            self._pids.pop(label, None)
            self._up[label] = False

    def update(self, label: str, pid: int, samples: list[list]) -> bool:
        """A STATS report; False (and ignored) unless `pid` is the stage's running process."""
        with self._lock:
            if self._pids.get(label) != pid:
                return False
            self._latest[label] = samples
            return True

    def waiting(self, label: str, restart_at: float | None, in_a_row: int) -> None:
        """Stage `label` died `in_a_row` times in a row; it starts again at `restart_at`
        (monotonic), or None once it runs."""
        with self._lock:
            self._in_a_row[label] = in_a_row
            if restart_at is None:
                self._restart_at.pop(label, None)
            else:
                self._restart_at[label] = restart_at

    def crash_loops(self, now: float) -> dict[str, tuple[int, float]]:
        """Stage label -> (deaths in a row, seconds until its next start, 0 while it runs)."""
        with self._lock:
            return {
                label: (n, max(0.0, self._restart_at.get(label, now) - now))
                for label, n in self._in_a_row.items()
            }

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return {label: n - 1 for label, n in self._starts.items()}

    def up(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._up)

    def _fold(self, label: str) -> None:
        """Keep the counters and histograms of the process that ran as `label` (lock held)."""
        for name, labels, value in self._latest.pop(label, ()):
            metric = METRICS.get(name)
            if metric is None:
                continue
            key = (name, tuple(labels))
            if metric.kind == COUNTER and metric.carry:
                self._carried[key] += float(value)
            elif metric.kind == HISTOGRAM:
                _add_histogram(self._carried_histograms, key, value)

    def snapshot(self) -> tuple[dict[Key, float], dict[Key, list]]:
        """(series -> value, histogram series -> [counts per bucket, sum]), merged."""
        with self._lock:
            values: dict[Key, float] = defaultdict(float, self._carried)
            histograms: dict[Key, list] = {}
            for key, value in self._carried_histograms.items():
                _add_histogram(histograms, key, value)
            for samples in self._latest.values():
                for name, labels, value in samples:
                    metric = METRICS.get(name)
                    if metric is None:
                        continue
                    key = (name, tuple(labels))
                    if metric.kind == HISTOGRAM:
                        _add_histogram(histograms, key, value)
                    else:
                        values[key] += float(value)
            return dict(values), histograms
