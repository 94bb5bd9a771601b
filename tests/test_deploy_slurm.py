"""deploy/slurm/fabric-workers.sbatch: workers as a Slurm array job, drained on Slurm's signal.

Slurm itself is not here: the script runs as the batch shell would (bash, with the
environment `sbatch --export` gives it), and gets the SIGTERM that `--signal=B:TERM@N`
sends the batch shell before the time limit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from broker import Broker, write_config
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "deploy" / "slurm" / "fabric-workers.sbatch"
DRAIN_MARGIN_S = 15  # a drained worker still sends its results and says goodbye


def directives() -> dict[str, str]:
    """The script's #SBATCH options, --name=value."""
    found = {}
    for line in SBATCH.read_text().splitlines():
        if match := re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line):
            found[match[1]] = match[2]
    return found


def run_script(env: dict[str, str], *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(SBATCH), *args],
        env={"PATH": os.environ["PATH"], "SLURM_ARRAY_TASK_ID": "3", **env},
        cwd=REPO,
        **popen,
    )


def test_the_script_parses_and_execs_a_worker_run_py_accepts_drained_before_the_limit(tmp_path):
    import run

    assert subprocess.run(["bash", "-n", str(SBATCH)], timeout=30).returncode == 0
    said = tmp_path / "argv.json"
    stub = tmp_path / "fabric-stub"  # stands in for `python run.py`: records what it was given
    stub.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(said)!r}, 'w'))\n"
    )
    stub.chmod(0o755)
    env = {
        "FABRIC": str(stub),
        "FABRIC_BROKER": "tcp://broker-host:7711",
        "FABRIC_HEARTBEAT": "tcp://broker-host:7712",
        "FABRIC_MODEL": "smol",
        "FABRIC_ENGINE": "vllm",
        "FABRIC_KEY": "/home/me/keys/gpu.key_secret",
        "FABRIC_SERVER_KEY": "/home/me/keys/broker.key",
    }
    done = run_script(env, "--option", "gpu_memory_utilization=0.8", stderr=subprocess.PIPE)
    _, err = done.communicate(timeout=30)
    assert done.returncode == 0, err
    args = run.parse_args(json.loads(said.read_text()))
    assert (args.command, args.broker, args.heartbeat) == (
        "worker",
        "tcp://broker-host:7711",
        "tcp://broker-host:7712",
    )
    assert (args.model, args.engine, args.option) == (
        "smol",
        "vllm",
        ["gpu_memory_utilization=0.8"],
    )
    assert (args.key, args.server_key) == (env["FABRIC_KEY"], env["FABRIC_SERVER_KEY"])

    # SIGTERM to the batch shell (B:), early enough for the default drain and its send.
    sbatch = directives()
    warn = re.fullmatch(r"B:TERM@(\d+)", sbatch["signal"])
    assert warn, sbatch["signal"]
    assert int(warn[1]) >= args.drain_s + DRAIN_MARGIN_S, (warn[1], args.drain_s)
    assert {"array", "time", "gres"} <= set(sbatch)

    missing = run_script({"FABRIC": str(stub)}, stderr=subprocess.PIPE, text=True)
    _, err = missing.communicate(timeout=30)
    assert missing.returncode != 0 and "FABRIC_BROKER" in err


def test_array_tasks_run_a_job_and_one_signalled_mid_job_drains_and_exits_0(tmp_path):
    config = write_config(tmp_path, workers=0)
    broker = Broker(config).start()
    s = broker.settings
    env = {
        "FABRIC": f"{sys.executable} {REPO / 'run.py'}",
        "FABRIC_BROKER": s.dispatch.bind,
        "FABRIC_HEARTBEAT": s.dispatch.heartbeat_bind,
        "FABRIC_MODEL": "sim",
        "FABRIC_ENGINE": "simulated",
        "FABRIC_DRAIN_S": "5",
    }
    line = {"method": "POST", "url": "/v1/embeddings", "body": {"model": "sim", "input": "w1 w2"}}
    n = 3000
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"custom_id": f"s{i}", **line}) + "\n" for i in range(n)))
    slow = ("--option", "tokens_per_s=1000", "--batch-items", "32", "--target-batch-s", "0")
    tasks: list[subprocess.Popen] = []
    try:
        done = run_cli("submit", str(data), "--job-id", "slurm", "--config", str(config))
        assert done.returncode == 0, done.stderr
        tasks.append(run_script(env, *slow, stderr=subprocess.PIPE, text=True))
        wait_for(
            lambda: 0 < broker.job_status("slurm")["completed"] < n // 2,
            "the first array task to complete some of the job",
            timeout_s=60,
        )
        tasks[0].send_signal(signal.SIGTERM)  # what --signal=B:TERM@N does before the limit
        _, err = tasks[0].communicate(timeout=30)
        assert tasks[0].returncode == 0, err  # drained: the worker itself got the signal
        assert broker.job_status("slurm")["completed"] < n  # it stopped mid-job

        tasks.append(run_script(env, stderr=subprocess.PIPE, text=True))  # the next task
        out = tmp_path / "out.jsonl"
        fetched = run_cli("results", "slurm", "-o", str(out), "--follow", "--config", str(config))
        assert fetched.returncode == 0, fetched.stderr
        ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
        assert sorted(ids) == sorted(f"s{i}" for i in range(n))  # each line once
        tasks[1].send_signal(signal.SIGTERM)
        _, err = tasks[1].communicate(timeout=30)
        assert tasks[1].returncode == 0, err
        assert broker.stop() == 0
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
                task.communicate(timeout=30)
        broker.close()
    assert_check_clean(broker.data_dir)
