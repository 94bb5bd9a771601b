"""Processes: the stage base and its run loop, the supervisor, the fork server, heartbeats, start-up checks and the banner. The top room of pipeline/.

Rooms of pipeline/ (docs/architecture.md, "Floors"): process > telemetry > store | transport > core,
kept by the import-linter contract in pyproject.toml.

| module                 | what |
|------------------------|------|
| `announce.py`          | What the broker says on its terminal (stderr): for people, not for programs |
| `fork_server.py`       | The fork server the stage processes come from, started as a fork of the supervisor |
| `heartbeat.py`         | The stateless heartbeat port the supervisor answers: PING -> the broker's epoch, and |
| `logs.py`              | Per-stage log files: `<data_dir>/log/<stage>-<n>.log`, one line per event |
| `preflight.py`         | What the broker checks before it says "serving": files named in the config, and ports |
| `signal_wake.py`       | A pipe that signals write to, so that a loop waiting on file descriptors wakes at once |
| `stage.py`             | The stage base: one OS process, one `step(now)` loop, flags set by signals |
| `stage_child.py`       | One stage process as the supervisor keeps it (pipeline/process/supervisor.py): `StageChild`, with |
| `stage_restarts.py`    | What `status` says about stages that keep dying, from the supervisor's report |
| `supervisor.py`        | The supervisor: lock the data dir, recover, then start, watch and restart every stage |
| `supervisor_report.py` | The supervisor's own report of its stages: `<data_dir>/supervisor.json` |
"""
