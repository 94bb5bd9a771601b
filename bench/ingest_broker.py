"""A real broker for the ingest benchmark: its config, its processes, their memory, its check.

`BenchBroker(root, models, tokenizer_processes)` writes a config under
`root` (free loopback ports, 256 MiB segments, 4096-item chunks, default
process counts and no local workers unless `sections` says otherwise), starts `python run.py --config` in a
subprocess and waits until every stage's log says it is up. While it runs,
`RssSampler` sums VmRSS over the supervisor and every process under it every
0.2 s. `stop()` sends SIGTERM and returns the exit code; `check()` runs
`python run.py check` on the data dir. `close()` kills what is left and
removes the rings and the data.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from assembly.stages import stage_specs
from config import load_settings
from pipeline.process.supervisor_report import all_up, read_report, stage_pids
from pipeline.transport.ports import free_loopback_ports
from pipeline.transport.ring import Ring
from pipeline.transport.topology import ring_specs, run_dir

REPO = Path(__file__).resolve().parent.parent
SEGMENT_BYTES = 256 << 20
CHUNK_ITEMS = 4096
UP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 120.0


def free_port() -> int:
    return free_loopback_ports(1)[0]


@dataclass(frozen=True)
class Model:
    name: str
    tokenizer: str = ""  # path of a tokenizer.json; "" = token ids only
    endpoints: tuple[str, ...] = ("/v1/embeddings",)
    engine: str = "echo"  # bench/reuse.py runs the simulated engine


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_config(
    root: Path,
    models: list[Model],
    tokenizer_processes: int = 1,
    sections: dict[str, dict[str, object]] | None = None,
) -> Path:
    """A broker config with its data dir under `root` and free loopback ports.

    No local workers unless `sections` asks for them (`{"workers": {"local": 2}}`):
    an ingest benchmark measures a log that nothing consumes. `sections` is
    merged over the base, key by key.
    """
    ports = free_loopback_ports(6)
    base: dict[str, dict[str, object]] = {
        "broker": {"data_dir": str(root / "data"), "segment_bytes": SEGMENT_BYTES},
        "ingest": {
            "bind": f"tcp://127.0.0.1:{ports[0]}",
            "chunk_items": CHUNK_ITEMS,
            "processes": tokenizer_processes,
        },
        "dispatch": {
            "bind": f"tcp://127.0.0.1:{ports[1]}",
            "heartbeat_bind": f"tcp://127.0.0.1:{ports[2]}",
        },
        "completion": {"bind": f"tcp://127.0.0.1:{ports[3]}"},
        "vectors": {"bind": f"tcp://127.0.0.1:{ports[4]}"},
        "workers": {"local": 0},
        "metrics": {"bind": f"127.0.0.1:{ports[5]}"},  # not the default: another broker may run
    }
    for name, keys in (sections or {}).items():
        base.setdefault(name, {}).update(keys)
    text = "".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in keys.items())
        for name, keys in base.items()
    )
    text += "".join(
        f'\n[[models]]\nname = "{m.name}"\nengine = "{m.engine}"\nendpoints = {_toml(m.endpoints)}\n'
        + (f'tokenizer = "{m.tokenizer}"\n' if m.tokenizer else "")
        for m in models
    )
    path = root / "broker.toml"
    path.write_text(text)
    return path


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (children of every thread, recursively)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                text = Path(f"/proc/{current}/task/{tid}/children").read_text()
            except OSError:
                continue
            todo += [int(child) for child in text.split()]
    return found


def rss_bytes(pid: int) -> int:
    """VmRSS of one process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class RssSampler:
    """A thread reading VmRSS of every process in a tree every `every_s`.

    `samples` holds (monotonic time, {pid: bytes}); a process that started
    or ended between samples is in some of them only.
    """

    pid: int
    every_s: float = 0.2
    samples: list[tuple[float, dict[int, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(
                (time.monotonic(), {pid: rss_bytes(pid) for pid in descendants(self.pid)})
            )
            self._stop.wait(self.every_s)

    def at(self, when: float) -> dict[int, int]:
        """The first sample taken at or after `when` (the last one if none is)."""
        for taken, sizes in self.samples:
            if taken >= when:
                return sizes
        return self.samples[-1][1]

    def before(self, when: float) -> dict[int, int]:
        """The last sample taken at or before `when` (the first one if none is)."""
        best = self.samples[0][1]
        for taken, sizes in self.samples:
            if taken > when:
                break
            best = sizes
        return best

    def peak(self, until: float) -> int:
        """The largest sum over the tree among the samples taken up to `until`."""
        return max(sum(sizes.values()) for taken, sizes in self.samples if taken <= until)


class BenchBroker:
    """`python run.py --config FILE` in a subprocess, for one benchmark step."""

    def __init__(
        self,
        root: Path,
        models: list[Model],
        tokenizer_processes: int = 1,
        sections: dict[str, dict[str, object]] | None = None,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.config = write_config(root, models, tokenizer_processes, sections)
        self.settings = load_settings(self.config)
        self.data = root / "data"
        self.log_dir = self.data / "log"
        self.stages = len(stage_specs(self.settings))
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> BenchBroker:
        self.address = load_settings(self.config).ingest.bind
        self._stderr = open(self.root / "broker.stderr", "w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "run.py"), "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            cwd=REPO,
        )
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not self.all_up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited with {self.proc.returncode}: {self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker's stages were not up in {UP_TIMEOUT_S:g} s")
            time.sleep(0.05)
        return self

    def _tail(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()[-2000:]

    def _report(self) -> dict | None:
        """The supervisor's report of this broker's life (pipeline/process/supervisor_report.py)."""
        report = read_report(self.data)
        return report if report is not None and report.get("pid") == self.proc.pid else None

    def pids(self) -> dict[str, int]:
        """The pid of each running stage, from the supervisor's report."""
        return stage_pids(self._report())

    def all_up(self) -> bool:
        report = self._report()
        return all_up(report, self.proc.pid) and len(report["stages"]) >= self.stages

    def stage_log_problems(self) -> list[str]:
        """WARNING, ERROR and traceback lines from every stage log (a clean run has none)."""
        lines = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines += [
                f"{path.name}: {line}"
                for line in path.read_text().splitlines()
                if " WARNING " in line or " ERROR " in line or "Traceback" in line
            ]
        return lines

    def stop(self) -> int:
        """SIGTERM, wait; the supervisor's exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def check(self) -> tuple[int, str]:
        """`run.py check --config`: its exit code and last line of output."""
        done = subprocess.run(
            [sys.executable, str(REPO / "run.py"), "check", "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        out = (done.stdout + done.stderr).strip().splitlines()
        return done.returncode, out[-1] if out else ""

    def data_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.data.rglob("*") if p.is_file())

    def close(self) -> None:
        """Kill whatever is left, remove its rings, its ipc socket directory and its data.
        Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc is not None:
            for ring in ring_specs(self.settings):
                Ring.unlink(ring.name)
            shutil.rmtree(run_dir(self.settings), ignore_errors=True)
            self._stderr.close()
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds one process has used so far ((0, 0) if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick
