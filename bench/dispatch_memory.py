"""Step 3 of bench/dispatch.py: the dispatch stage's memory as the queue grows to 10 M items.

A broker with no workers takes jobs of `per_job` 64-token items (the same
rows each time, a new job each) until `total` items are queued. After each
job, once dispatch's status counts every item queued so far, the dispatch
process's VmRSS (and its parts: RssAnon, RssFile, RssShmem; and VmHWM, the
peak) is read from /proc/PID/status, PID from the supervisor's log
("started stage dispatch-0 (pid N)"). Flat means the state does not grow
with the backlog: per segment a cursor and an end, nothing per item.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from bench.dispatch_common import MODEL, Status, make_rows, memory, submit, wait_for
from bench.ingest_broker import BenchBroker
from bench.ingest_common import Outcome, progress
from bench.report import Row
from pipeline.store.segment_format import slot_bytes_for

STEP = "3 memory"
TOKENS = 64
SLOT_BYTES = slot_bytes_for(TOKENS * 4)  # 288
RSS_TARGET_MIB = 100
SPARE_BYTES = 4 << 30


@dataclass(frozen=True)
class Backlog:
    total: int
    per_job: int
    note: str = ""


def fit_to_disk(root: Path, total: int, per_job: int) -> Backlog:
    """Scale the backlog down, and say so, if the disk cannot hold it (plus the completion log
    and index files, and room to spare)."""
    free = shutil.disk_usage(root).free
    per_item = SLOT_BYTES + 16
    needed = total * per_item + SPARE_BYTES
    if needed <= free:
        return Backlog(total, per_job)
    fits = max(per_job, int((free - SPARE_BYTES) // per_item) // per_job * per_job)
    note = (
        f"Step 3 scaled down: {free / 2**30:.1f} GiB free under {root} but {total:,} items of "
        f"{TOKENS} tokens need {needed / 2**30:.1f} GiB; queued {fits:,} instead."
    )
    return Backlog(fits, per_job, note)


def bench_memory(root: Path, backlog: Backlog, outcome: Outcome) -> list[Row]:
    if backlog.note:
        outcome.notes.append(backlog.note)
    broker = BenchBroker(root / "memory", [MODEL])
    samples: list[tuple[int, dict[str, int]]] = []
    try:
        broker.start()
        pid = broker.pids()["dispatch-0"]
        samples.append((0, memory(pid)))
        status = Status(broker)
        try:
            rows = make_rows(backlog.per_job, TOKENS)
            queued = 0
            for k in range(backlog.total // backlog.per_job):
                submit(broker, f"memory-{k}", rows)
                queued += backlog.per_job
                wait_for(lambda q=queued: status.queued() >= q, f"{queued:,} items queued", 120)
                samples.append((queued, memory(pid)))
                progress(
                    f"step 3: {queued:,} items queued; dispatch-0 VmRSS "
                    f"{samples[-1][1].get('VmRSS', 0) / 2**20:.1f} MiB"
                )
            segments = len(status.dispatch()["queues"])
        finally:
            status.close()
        restarted = broker.pids()["dispatch-0"] != pid
        outcome.checks.append(
            (f"step 3 dispatch-0 kept one pid through the run ({pid})", not restarted)
        )
        code = broker.stop()
        outcome.checks.append(
            (f"step 3 broker stopped by SIGTERM: exit code {code} (expected 0)", code == 0)
        )
        data_gib = broker.data_bytes() / 2**30
    finally:
        broker.close()
    return _rows(samples, segments, data_gib, outcome)


def _rows(samples, segments: int, data_gib: float, outcome: Outcome) -> list[Row]:
    def mib(sample: dict[str, int], key: str = "VmRSS") -> float:
        return sample.get(key, 0) / 2**20

    first = next(s for n, s in samples if n > 0)
    first_n = next(n for n, _ in samples if n > 0)
    last_n, last = samples[-1]
    outcome.notes.append(
        "Step 3: dispatch-0 VmRSS by items queued: "
        + ", ".join(f"{n / 1e6:g} M {mib(s):.1f} MiB" for n, s in samples)
        + f". {segments} segment(s) queued at the end; the data dir held {data_gib:.1f} GiB "
        "(removed at the end). RssFile counts pages of the memory-mapped segment files that "
        "this process has touched (headers, marker pages): they are the page cache, shared, "
        "and reclaimable."
    )
    return [
        Row(STEP, "dispatch-0 VmRSS, empty broker, MiB", (mib(samples[0][1]),)),
        Row(STEP, f"dispatch-0 VmRSS at {first_n / 1e6:g} M queued, MiB", (mib(first),)),
        Row(
            STEP,
            f"dispatch-0 VmRSS at {last_n / 1e6:g} M queued, MiB",
            (mib(last),),
            target=f"< {RSS_TARGET_MIB} MiB",
            below=RSS_TARGET_MIB,
        ),
        Row(
            STEP,
            f"dispatch-0 VmRSS growth {first_n / 1e6:g} M -> {last_n / 1e6:g} M, MiB",
            (mib(last) - mib(first),),
        ),
        Row(STEP, f"of which RssAnon at {last_n / 1e6:g} M, MiB", (mib(last, "RssAnon"),)),
        Row(STEP, f"of which RssFile at {last_n / 1e6:g} M, MiB", (mib(last, "RssFile"),)),
        Row(STEP, f"of which RssShmem at {last_n / 1e6:g} M, MiB", (mib(last, "RssShmem"),)),
        Row(
            STEP,
            f"RssAnon growth {first_n / 1e6:g} M -> {last_n / 1e6:g} M, MiB",
            (mib(last, "RssAnon") - mib(first, "RssAnon"),),
        ),
        Row(STEP, "dispatch-0 VmHWM (peak RSS) at the end, MiB", (mib(last, "VmHWM"),)),
    ]
