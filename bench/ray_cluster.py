"""A local Ray cluster of one head node, for the Ray fleet's tests and benchmark
(tests/test_ray_fleet.py, bench/ray_fleet.py): `ray start --head --block` on loopback ports
reserved host-wide (pipeline/transport/ports.py), and its processes killed by pid at the end.

Ray's own ports are named here, each a reserved one, so that no broker of another test
process is handed a port Ray took; its workers' ports stay in Ray's default range
(10002-19999), below the brokers' (20000 and up). `stop` kills the head's processes and
every process they started (its actors' workers), each by its pid: `ray stop` would stop
every Ray cluster of the host.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from pipeline.transport.ports import free_loopback_ports

RAY = Path(sys.executable).parent / "ray"
START_S = 90.0  # the head's GCS answers within this long, on a loaded 2-core host


class LocalRay:
    """One head node: `start()`, its `address`, then `stop()`."""

    def __init__(self, num_cpus: int = 4) -> None:
        self.num_cpus = num_cpus
        self.root = Path(tempfile.mkdtemp(prefix="fabric-ray-", dir="/tmp"))  # short: sockets
        self.ports = free_loopback_ports(7)
        self.address = f"127.0.0.1:{self.ports[0]}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LocalRay:
        p = self.ports
        argv = [
            str(RAY),
            *("start", "--head", "--block", "--disable-usage-stats"),
            *("--include-dashboard", "false", "--node-ip-address", "127.0.0.1"),
            *("--port", str(p[0]), "--node-manager-port", str(p[1])),
            *("--object-manager-port", str(p[2]), "--runtime-env-agent-port", str(p[3])),
            *("--dashboard-agent-grpc-port", str(p[4]), "--dashboard-agent-listen-port", str(p[5])),
            *("--metrics-export-port", str(p[6])),
            *("--num-cpus", str(self.num_cpus), "--num-gpus", "0"),
            *("--temp-dir", str(self.root / "t"), "--object-store-memory", str(100 << 20)),
        ]
        log = open(self.root / "ray-start.log", "w")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + START_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = (self.root / "ray-start.log").read_text()[-2000:]
                self.stop()
                raise RuntimeError(f"ray start --head did not come up: {said}")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.ports[0]), timeout=0.5):
                return True
        except OSError:
            return False

    def processes(self) -> list[psutil.Process]:
        """The head's processes and every one they started (actors' workers included)."""
        if self.proc is None:
            return []
        try:
            head = psutil.Process(self.proc.pid)
            return [head, *head.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """Kill every process of this cluster by its pid, then remove its files."""
        found = self.processes()
        for process in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(found, timeout=30)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)
