"""The end of a chaos run: each job's outcomes against its input, and the data dir checked.

`Verdict.verify` reads a finished job's output and error files (each input line exactly
one outcome, no custom_id twice, the poison item an error) and compares the broker's
counters with them; `check_data_dir` runs `run.py check` on the stopped broker's data dir
and starts it once more to see every input segment collected. `stuck_work` names what
dispatch still holds when a job does not finish. Findings go into the run's `Report`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

from bench.chaos_fleet import REPO, BrokerProcess, Job, run_py
from bench.chaos_report import Report


class Verdict:
    """Checks against one broker (its config and data dir), written into `report`."""

    def __init__(self, config: Path, data_dir: Path, report: Report) -> None:
        self.config, self.data_dir, self.report = config, data_dir, report

    def status(self, *job: str) -> dict:
        """`run.py status [JOB] --json`: the broker's own answer ({} if it gave none)."""
        answer = subprocess.run(
            run_py("status", *job, "--json", "--config", str(self.config)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        return json.loads(answer.stdout) if answer.returncode == 0 else {}

    def job_counts(self, job: Job) -> str:
        info = self.status(job.spec.job_id)
        if not info:
            return "no status answer"
        return (
            f"state {info.get('state')}, {info.get('completed')} completed + "
            f"{info.get('failed')} failed of {info.get('total')}"
        )

    def stuck_work(self) -> str:
        """What dispatch says is still out or queued: (segment, slots, session) per lease."""
        info = self.status()
        if not info:
            return "dispatch gave no status answer"
        leases = [
            f"segment {b['segment']} slots {b['slots']}{'...' if b['items'] > len(b['slots']) else ''}"
            f" with session {b['session']} for {b['held_s']} s"
            + (" (answered, retire pending)" if b["answered"] else "")
            + (" (session stalled)" if b["stalled"] else "")
            for b in info.get("leases", [])
        ]
        queued = [f"segment {q['segment']}: {q['queued']} queued" for q in info.get("queues", [])]
        workers = [
            f"{w['session']} ({w['model']}, {w['batches']} batch(es), silent {w['silent_s']} s"
            + (", stalled" if w.get("stalled") else "")
            + ")"
            for w in info.get("workers", [])
        ]
        return (
            f"dispatch: on lease: {'; '.join(leases) or 'nothing'}; "
            f"queued: {'; '.join(queued) or 'nothing'}; workers: {'; '.join(workers) or 'none'}"
        )

    def verify(self, job: Job) -> None:
        spec, report = job.spec, self.report
        report.jobs += 1
        report.lines += spec.lines
        report.submit_runs += job.submit.runs
        report.fetch_runs += job.fetch.runs
        seen: Counter = Counter()
        outputs = errors = 0
        poison_error = None
        for path, is_error in ((job.out, False), (job.err, True)):
            for raw in path.read_text().splitlines() if path.exists() else []:
                line = json.loads(raw)
                custom_id = line["custom_id"]
                if custom_id is None:  # a broken line: `<job>-line-<n>`
                    number = int(line["id"].rsplit("-", 1)[1])
                else:
                    number = int(custom_id.rsplit("-", 1)[1])
                seen[number] += 1
                outputs += not is_error
                errors += is_error
                if number == spec.poison_line:
                    poison_error = line["error"] if is_error else "an output line"
        lost = [n for n in range(1, spec.lines + 1) if not seen[n]]
        doubled = [n for n, c in seen.items() if c > 1]
        report.lost += len(lost)
        report.doubled += len(doubled)
        if lost or doubled:
            report.problems.append(
                f"job {spec.job_id}: lost lines {lost[:10]}, doubled {doubled[:10]}"
            )
        if not isinstance(poison_error, dict):
            report.problems.append(f"job {spec.job_id}: the poison item ended as {poison_error!r}")
        info = self.status(spec.job_id)
        if info.get("state") != "completed":
            report.problems.append(f"job {spec.job_id}: state {info.get('state')!r} once fetched")
        elif info["completed"] != outputs or info["failed"] != errors:
            report.counter_mismatches += 1
            report.problems.append(
                f"job {spec.job_id}: counters say {info['completed']} completed and "
                f"{info['failed']} failed; the files hold {outputs} and {errors}"
            )

    def check_data_dir(self, broker: BrokerProcess) -> None:
        check = subprocess.run(
            run_py("check", "--config", str(self.config)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        if check.returncode != 0:
            self.report.problems.append(f"check found: {check.stdout.strip()[-2000:]}")
        # Collected: a last start lets the collector remove the finished jobs' segments.
        broker.start()
        segments = self.data_dir / "segments"
        deadline = time.monotonic() + 60
        while any(segments.glob("in-*.seg")) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p.name for p in segments.glob("in-*.seg"))
        if left:
            self.report.problems.append(f"{len(left)} input segment(s) never collected: {left[:5]}")
        if broker.stop() != 0:
            self.report.problems.append("the broker did not stop cleanly after the check")
