"""Run a Supervisor over test stages: `python supervise.py DATA_DIR NAME:COUNT ...`.

FABRIC_TEST_IDLE_WAIT_S, if set, is the supervisor's longest idle wait (IDLE_WAIT_S)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.errors import DataDirLockedError
from pipeline.process import supervisor
from pipeline.process.stage import StageSpec
from pipeline.process.supervisor import Supervisor
from pipeline.transport.ports import free_loopback_ports

STAGES = {  # tests/procs/stages.py
    "idle": "stages:IdleStage",
    "polling": "stages:PollingStage",
    "crash": "stages:CrashStage",
}


def main() -> int:
    ports = free_loopback_ports(6)  # never the defaults: other brokers may run on this host
    settings = load_settings(
        None,
        {
            "broker": {"data_dir": sys.argv[1]},
            "ingest": {"bind": f"tcp://127.0.0.1:{ports[0]}"},
            "dispatch": {
                "bind": f"tcp://127.0.0.1:{ports[1]}",
                "heartbeat_bind": f"tcp://127.0.0.1:{ports[2]}",
            },
            "completion": {"bind": f"tcp://127.0.0.1:{ports[3]}"},
            "vectors": {"bind": f"tcp://127.0.0.1:{ports[4]}"},
            "metrics": {"bind": f"127.0.0.1:{ports[5]}"},
            "supervisor": {"restart_backoff_s": 0.1, "max_restarts": 3, "restart_window_s": 30.0},
        },
    )
    if wait_s := os.environ.get("FABRIC_TEST_IDLE_WAIT_S"):
        supervisor.IDLE_WAIT_S = float(wait_s)
    specs = []
    for arg in sys.argv[2:]:
        name, count = arg.split(":")
        specs += [StageSpec(name, i, STAGES[name], settings) for i in range(int(count))]
    try:
        return Supervisor(settings, specs).run()
    except DataDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.LOCKED


if __name__ == "__main__":
    sys.exit(main())
