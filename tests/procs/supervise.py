"""Run a Supervisor over test stages: `python supervise.py DATA_DIR NAME:COUNT ...`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config import load_settings
from pipeline import exitcodes
from pipeline.errors import DataDirLockedError
from pipeline.stage import StageSpec
from pipeline.supervisor import Supervisor

TARGETS = {"idle": "stages:IdleStage", "crash": "stages:CrashStage"}


def main() -> int:
    settings = load_settings(
        None,
        {
            "broker": {"data_dir": sys.argv[1]},
            "supervisor": {"restart_backoff_s": 0.1, "max_restarts": 3, "restart_window_s": 30.0},
        },
    )
    specs = []
    for arg in sys.argv[2:]:
        name, count = arg.split(":")
        specs += [StageSpec(name, i, TARGETS[name]) for i in range(int(count))]
    try:
        return Supervisor(settings, specs).run()
    except DataDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.LOCKED


if __name__ == "__main__":
    sys.exit(main())
