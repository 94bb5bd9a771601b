"""A real broker for tests: its config, its processes, and what its supervisor reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from subprocess import CompletedProcess

import numpy as np
import zygote
from client_commands import run_cli
from conftest import wait_for
from prometheus_client.parser import text_string_to_metric_families

from pipeline.core.errors import FabricError
from pipeline.process.supervisor_report import all_up, left_from_last_life, read_report, stage_pids
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.transport.ports import free_loopback_ports
from pipeline.transport.ring import Ring
from pipeline.transport.security import client_curve
from pipeline.transport.topology import client_address, ring_specs

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    """n free loopback ports, reserved host-wide for this test (pipeline/transport/ports.py): no other
    test process, on this host or in another suite, gets them while this test runs, even while
    its broker is killed and down. conftest.py's `ports_of_the_test` gives them back after the
    test; a module's or the session's fixture keeps its own until the process ends."""
    return free_loopback_ports(n)


def free_port() -> int:
    return free_ports(1)[0]


WORDS = [f"w{i}" for i in range(1000)]
TEXT_LIMIT_TOKENS = 64  # the `texty` model's max_tokens: longer text lines are rejected


def build_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json over WORDS (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))
    return path


def write_config(
    tmp_path: Path,
    extra: str = "",
    tokenizers: int = 1,
    routers: int = 1,
    writers: int = 1,
    workers: int = 0,
    dispatch: str = "",
    worker_keys: str = "",
    vectors: str = "",
    data_dir: Path | None = None,
    broker_keys: str = "",
    segment_bytes: int = 4194304,
) -> Path:
    """A config with a data dir under tmp_path (or at `data_dir`), free loopback ports, and
    three models: `echo` (token ids only), `texty` (text, with a small word-level tokenizer)
    and `sim` (the simulated engine's 384-dim embeddings of the same text). `broker_keys`
    are more lines for the [broker] section."""
    tokenizer = build_tokenizer(tmp_path / "tokenizer.json")
    ports = free_ports(6)
    text = f"""
[broker]
data_dir = "{data_dir or tmp_path / "data"}"
segment_bytes = {segment_bytes}
{broker_keys}
[ingest]
bind = "tcp://127.0.0.1:{ports[0]}"
chunk_items = 200
chunk_timeout_s = 5.0
processes = {tokenizers}
[router]
processes = {routers}
[writers]
processes = {writers}
[dispatch]
bind = "tcp://127.0.0.1:{ports[1]}"
heartbeat_bind = "tcp://127.0.0.1:{ports[2]}"
{dispatch}
[workers]
local = {workers}
{worker_keys}
[vectors]
bind = "tcp://127.0.0.1:{ports[5]}"
{vectors}
[completion]
bind = "tcp://127.0.0.1:{ports[3]}"
[metrics]
bind = "127.0.0.1:{ports[4]}"
[supervisor]
restart_backoff_s = 0.2
stop_timeout_s = 20.0
{extra}
[[models]]
name = "echo"
engine = "echo"
endpoints = ["/v1/embeddings"]
[[models]]
name = "texty"
engine = "echo"
endpoints = ["/v1/embeddings"]
tokenizer = "{tokenizer}"
max_tokens = {TEXT_LIMIT_TOKENS}
[[models]]
name = "sim"
engine = "simulated"
endpoints = ["/v1/embeddings"]
tokenizer = "{tokenizer}"
max_tokens = {TEXT_LIMIT_TOKENS}
"""
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return path


def probe(bind: str, path: str, timeout_s: float = 5.0) -> tuple[int, str] | None:
    """(status, body) of GET http://bind/path, or None when nothing answered in time."""
    try:
        with urllib.request.urlopen(f"http://{bind}{path}", timeout=timeout_s) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()
    except TimeoutError:
        return None
    except urllib.error.URLError as exc:  # a connect that timed out
        if isinstance(exc.reason, TimeoutError):
            return None
        raise


class Broker:
    """`python run.py --config FILE` in a subprocess (forked by tests/zygote.py: the broker's
    imports are done once per test process, not at each of its lives)."""

    def __init__(self, config: Path, stderr_path: Path | None = None) -> None:
        """`stderr_path`: the broker's stderr goes to that file instead of a pipe (a pipe
        nobody reads fills up and blocks the stages, e.g. while logging fails on a full disk)."""
        self.config = config
        self.stderr_path = stderr_path
        from config import load_settings

        self.settings = load_settings(config)
        self.data_dir = DataDir(self.settings.data_path)
        self.address = self.settings.ingest.bind
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> Broker:
        """Starts the broker and waits `timeout_s` for every stage, local workers included
        (a worker is up once its engine has loaded: minutes for vLLM on 2 cores)."""
        self.launch()
        try:
            wait_for(
                lambda: self.all_up() or self.proc.poll() is not None,
                "every stage to be up",
                timeout_s=timeout_s,
            )
        except BaseException:  # not up in time: killed here, not left running to the collector
            self.close()  # (an unreaped child and its pipe are ResourceWarnings in a later test)
            raise
        if self.proc.poll() is not None:  # it exited at start: say why at once
            said = self.stderr_path.read_text() if self.stderr_path else self.proc.stderr.read()
            self._close_stderr()
            raise AssertionError(f"the broker exited ({self.proc.returncode}) at start: {said}")
        return self

    def launch(self) -> Broker:
        """Starts the broker without waiting for it (`start` waits)."""
        path = self.stderr_path
        err = subprocess.PIPE if path is None else open(path, "w")  # noqa: SIM115
        self.proc = zygote.Popen(
            [sys.executable, str(REPO / "run.py"), "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            cwd=REPO,
        )
        if self.stderr_path is not None:
            err.close()
        return self

    def worker_argv(self, model: str, engine: str, *options: str, batch_items: int = 8) -> list:
        """`python run.py worker` against this broker, for `model` on `engine`, its own process
        as on a GPU host; `options`: `--option=KEY=VALUE` flags; batches cut as they come."""
        settings = self.settings.dispatch
        return [
            sys.executable,
            str(REPO / "run.py"),
            "worker",
            *("--broker", settings.bind, "--heartbeat", settings.heartbeat_bind),
            *("--model", model, "--engine", engine, *options),
            *("--batch-items", str(batch_items), "--target-batch-s", "0"),
        ]

    def supervisor_log(self) -> str:
        """For people reading a failure; tests wait on `report()`, never on log text."""
        path = self.data_dir.log / "supervisor-0.log"
        return path.read_text() if path.exists() else ""

    def report(self) -> dict | None:
        """The supervisor's report of this broker life (pipeline/process/supervisor_report.py)."""
        report = read_report(self.data_dir.root)
        if report is None or self.proc is None or report.get("pid") != self.proc.pid:
            return None
        return report

    def pids(self) -> dict[str, int]:
        """The pid of each running stage of this broker life."""
        return stage_pids(self.report())

    def restarts(self) -> dict[str, int]:
        """Stage label -> how many times the supervisor restarted it in this broker life."""
        report = self.report()
        return {s["stage"]: s["restarts"] for s in report["stages"]} if report else {}

    def all_up(self) -> bool:
        """Every stage of this life is up: each had opened its sockets (so a client finds
        every port listening), and each restarted one is up again."""
        return all_up(self.report(), self.proc.pid)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of metric `name` whose labels include `labels`, scraped from
        the supervisor's metrics endpoint now (0 when none)."""
        with urllib.request.urlopen(
            f"http://{self.settings.metrics.bind}/metrics", timeout=10
        ) as r:
            text = r.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    def job_status(self, job: str) -> dict:
        """What `run.py status JOB --json` prints, asked in-process: a status command per poll
        costs a new interpreter (about half a second of CPU), taken from the broker waited on."""
        from collector.job_state import with_in_flight
        from collector.results_client import ResultsClient

        with ResultsClient(self._client_address("completion"), curve=self._curve()) as client:
            info = client.job_status(job)
        try:
            broker = self.broker_status(attempts=1)
        except FabricError:  # as the command: which items are with workers is only a detail
            broker = None
        return with_in_flight(info, broker)

    def broker_status(self, attempts: int = 5) -> dict:
        """What `run.py status --json` prints (dispatch's BROKER_INFO), asked in-process."""
        from collector.results_client import DispatchClient

        address = self._client_address("dispatch")
        with DispatchClient(address, attempts=attempts, curve=self._curve()) as client:
            return client.broker_status()

    def _client_address(self, section: str) -> str:
        return client_address(getattr(self.settings, section).bind)

    def _curve(self):
        return client_curve(self.settings.security)

    def kill_stage(self, label: str) -> int:
        pid = self.pids()[label]
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: self.pids().get(label, pid) != pid and self.all_up(), f"{label} to be restarted"
        )
        return pid

    def kill(self) -> None:
        """SIGKILL the supervisor, and wait until its stages are gone too: each dies with it
        but takes a moment to exit, and until it has, its ports are bound. A broker started
        on the same data dir waits for them itself (`left_from_last_life`); one started on a
        data dir made again, or after a power cut took the report, could not, and would be
        refused (exit 3)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_stderr()
        root = self.data_dir.root
        wait_for(lambda: not left_from_last_life(root), "the killed broker's stages to exit", 30)

    def _close_stderr(self) -> None:
        """Close the pipe of the broker's stderr: one left to the garbage collector is a
        ResourceWarning (an error in this suite) in whichever test runs when it is collected."""
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=90)
        self.stderr = err if self.stderr_path is None else self.stderr_path.read_text()
        return self.proc.returncode

    def close(self) -> None:
        """Kill whatever is left and remove its rings (a killed supervisor cannot)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        self._close_stderr()  # it may have exited by itself
        for ring in ring_specs(self.settings):
            Ring.unlink(ring.name)


def submit(config: Path, path: Path, *args: str, timeout_s: float = 120) -> CompletedProcess:
    """`run.py submit PATH --config CONFIG ARGS`, run in this process
    (tests/client_commands.py): what it printed and its exit code. `timeout_s` is kept for
    callers; the command's own --timeout and --attempts bound it here, pytest-timeout the test."""
    del timeout_s
    return run_cli("submit", str(path), "--config", str(config), *args)


def seq_counts(data_dir: DataDir) -> Counter:
    """How many written slots hold each seq, across the whole input log."""
    counts: Counter = Counter()
    for path in sorted(data_dir.segments.glob("in-*.seg")):
        with Segment.open(path) as seg:
            written = np.flatnonzero(seg.states())
            counts.update(seg.slots["seq"][written].tolist())
    return counts


def write_jsonl(
    path: Path, n: int, seed: int = 0, bad_every: int = 0, text_every: int = 0
) -> set[int]:
    """n embedding lines; returns the indexes that must be stored.

    Every `bad_every`-th line is broken JSON; every `text_every`-th is text for
    `texty` (one in ten of those too long for it, so the tokenizer rejects it);
    the rest are token ids for `echo`.
    """
    import orjson

    rng = np.random.default_rng(seed)
    good = set()
    with open(path, "wb") as out:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                out.write(b'{"custom_id": "broken", "method": "POST"\n')
                continue
            if text_every and i % text_every == text_every - 1:
                too_long = i % (10 * text_every) == text_every - 1
                words = rng.choice(
                    WORDS, TEXT_LIMIT_TOKENS + 5 if too_long else int(rng.integers(1, 40))
                )
                body = {"model": "texty", "input": " ".join(words)}
                good |= set() if too_long else {i}
            else:
                tokens = rng.integers(1, 30000, int(rng.integers(1, 300))).tolist()
                body = {"model": "echo", "prompt_token_ids": tokens}
                good.add(i)
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(orjson.dumps(line) + b"\n")
    return good
