"""`run.py fleet --ray ADDRESS`: workers as Ray actors, sized by the broker's demand
(assembly/ray_fleet.py, docs/scaling.md "Ray").

One local Ray head node for the module (bench/ray_cluster.py: `ray start --head` on reserved
loopback ports, killed by pid at the end); each test has its own broker, its own Ray
namespace, and a controller run as a user runs it (`run.py fleet` in a subprocess). The
actors run the simulated engine, slowed so that a job lasts while a test kills things.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import orjson
import pytest
from broker import REPO, Broker, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from assembly.fleet import FAILED_PAUSE_S, ModelFleet, Plan, Slot, workers_needed
from bench.ray_cluster import LocalRay
from config import load_settings
from config.settings import build_fleet
from gpu.engines.base import EngineError
from gpu.engines.simulated import SimulatedEngine
from gpu.worker.hosted import HostedWorker
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError, FabricError

FAST = "lease_s = 30.0\nsession_timeout_s = 2.0\nreregister_grace_s = 0.5\nreport_s = 0.3"
ACTOR_TITLE = "ray::FleetActor"  # what `ps` shows for an actor's process
JOB_S = 60.0  # a job of LINES lines ends within this long of its last fault (the liveness bound)
LINES = 1500


@pytest.fixture(scope="module")
def ray_head():
    head = LocalRay(num_cpus=4).start()
    try:
        yield head
    finally:
        head.stop()


def fleet_config(
    tmp_path,
    min_actors: int,
    max_actors: int,
    tokens_per_s: float = 30000.0,
    horizon_s=300.0,
    security: str = "",
):
    """A broker config with one [[fleet]] table: model `echo` on the simulated engine;
    `horizon_s`: dispatch's demand_horizon_s (a short one asks for more workers);
    `security`: a [security] section."""
    table = f"""
[[fleet]]
model = "echo"
min = {min_actors}
max = {max_actors}
num_cpus = 0.5
engine = "simulated"
simulated_tokens_per_s = {tokens_per_s}
batch_items = 32
target_batch_s = 0.0
drain_s = 10.0
"""
    dispatch = f"{FAST}\ndemand_horizon_s = {horizon_s}"
    return write_config(tmp_path, dispatch=dispatch, extra=security + table)


class Controller:
    """`run.py fleet --ray ADDRESS --config CONFIG` as a user runs it."""

    def __init__(self, tmp_path, config, address: str, namespace: str) -> None:
        self.args = ["--ray", address, "--config", str(config), "--namespace", namespace]
        self.tmp_path = tmp_path
        self.lives = 0
        self.proc: subprocess.Popen | None = None

    def start(self, *flags: str) -> Controller:
        self.lives += 1
        log = open(self.tmp_path / f"fleet-{self.lives}.log", "w")  # noqa: SIM115
        argv = [sys.executable, str(REPO / "run.py"), "fleet", *self.args, "--interval-s", "0.5"]
        self.proc = subprocess.Popen([*argv, *flags], cwd=REPO, stdout=log, stderr=log)
        log.close()
        return self

    def once(self, *flags: str) -> subprocess.CompletedProcess:
        """`run.py fleet ... --list` or `--down`, to its end."""
        argv = [sys.executable, str(REPO / "run.py"), "fleet", *self.args, *flags]
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)

    def down(self) -> None:
        """Stop the controller, then drain and remove every actor of the namespace."""
        self.stop()
        done = self.once("--down")
        assert done.returncode == exitcodes.OK, done.stderr

    def log(self) -> str:
        return "\n".join(
            (self.tmp_path / f"fleet-{n}.log").read_text() for n in range(1, self.lives + 1)
        )


def actor_pids(head: LocalRay) -> set[int]:
    """The pids of the cluster's live actor processes."""
    pids = set()
    for process in head.processes():
        try:
            if process.cmdline()[:1] == [ACTOR_TITLE] or process.name() == ACTOR_TITLE:
                pids.add(process.pid)
        except Exception:  # gone meanwhile
            continue
    return pids


# A Ray driver of its own that kills actors when told, connected ahead (ray.init takes
# seconds): "kill NAME" ray.kill()s the actor for good, "crash NAME" SIGKILLs its process
# (Ray restarts it); each answers the actor's pid. "clear" kills every actor of the namespace.
DRIVER = """
import os, signal, sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], log_to_driver=False)
print("ready", flush=True)
for line in sys.stdin:
    word, name = line.split()[0], line.split()[-1]
    if word == "clear":
        for each in ray.util.list_named_actors():
            ray.kill(ray.get_actor(each), no_restart=True)
        print("cleared", flush=True)
        continue
    actor = ray.get_actor(name)
    pid = ray.get(actor.state.remote())["pid"]
    if word == "kill":
        ray.kill(actor, no_restart=True)
    else:
        os.kill(pid, signal.SIGKILL)
    print(pid, flush=True)
"""


class RayDriver:
    def __init__(self, address: str, namespace: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, address, namespace],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.answer(skip="ready")

    def answer(self, skip: str = "") -> str:
        said = skip
        while said == skip:  # `ask` skips the "ready" a failed test did not read
            said = self.proc.stdout.readline().strip()
            assert said, f"the Ray driver ended ({self.proc.wait()})"
        return said

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def sessions(b: Broker) -> list[dict]:
    try:
        return [w for w in b.broker_status(attempts=1)["workers"] if w["model"] == "echo"]
    except FabricError:
        return []


def submit(tmp_path, config, job: str, n: int = LINES) -> set[int]:
    path = tmp_path / f"{job}.jsonl"
    good = write_jsonl(path, n)
    done = run_cli("submit", str(path), "--job-id", job, "--config", str(config))
    assert done.returncode == 0, done.stderr
    return good


def results_once(tmp_path, config, job: str, good: set[int]) -> None:
    """Every line of the job has one result, each custom_id once."""
    out = tmp_path / f"{job}.out.jsonl"
    fetched = run_cli("results", job, "-o", str(out), "--follow", "--config", str(config))
    assert fetched.returncode == 0, fetched.stderr
    ids = [orjson.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)), "a custom_id was delivered twice"
    assert sorted(ids) == sorted(f"r{i}" for i in good)


@pytest.mark.slow
def test_fleet_scales_from_zero_runs_each_line_once_and_goes_back_to_zero(tmp_path, ray_head):
    """0 -> 2 -> 0: the job's work asks for 2 workers (3 s of horizon), its end for none."""
    config = fleet_config(tmp_path, 0, 2, tokens_per_s=20000.0, horizon_s=3.0)
    ctl = Controller(tmp_path, config, ray_head.address, "scale").start("--scale-down-s", "1")
    b = Broker(config)
    try:
        b.start()  # the controller connects to Ray meanwhile
        good = submit(tmp_path, config, "job")
        began = time.monotonic()
        wait_for(lambda: sessions(b), "an actor's worker to register", timeout_s=60)
        first_s = time.monotonic() - began
        # the first worker's measured rate makes workers_needed 2 (one is all the fallback
        # of a broker without a demand signal asks for)
        wait_for(lambda: len(sessions(b)) == 2, "the demand's 2nd actor", timeout_s=60)
        results_once(tmp_path, config, "job", good)
        drained = time.monotonic()
        wait_for(lambda: not sessions(b) and not actor_pids(ray_head), "the fleet at 0", 30)
        assert ray_head.processes(), "the cluster itself stays"
        print(f"0 -> 1 actor in {first_s:.1f} s; back to 0 in {time.monotonic() - drained:.1f} s")
    finally:
        ctl.stop()
        if actor_pids(ray_head):  # the test failed before the fleet went back to 0
            ctl.down()
    assert b.stop() == exitcodes.OK
    b.close()
    assert_check_clean(b.data_dir)


@pytest.mark.slow
def test_actors_killed_mid_batch_every_line_once(tmp_path, ray_head):
    config = fleet_config(tmp_path, 2, 2, tokens_per_s=15000.0)
    ctl = Controller(tmp_path, config, ray_head.address, "kill").start()
    driver = RayDriver(ray_head.address, "kill")
    b = Broker(config)
    try:
        b.start()
        wait_for(lambda: len(sessions(b)) == 2, "both actors' workers to register", 90)
        assert driver.answer() == "ready"
        good = submit(tmp_path, config, "job")
        wait_for(lambda: all(s["batches"] for s in sessions(b)), "both actors to hold batches")
        before = actor_pids(ray_head)
        # one's process dies (the OOM killer, a lost node): Ray restarts it; the other is
        # killed for good (ray.kill): the controller starts its slot again
        killed = {int(driver.ask("crash fabric-worker:echo#0"))}
        killed.add(int(driver.ask("kill fabric-worker:echo#1")))
        assert killed == before
        at = time.monotonic()
        assert b.job_status("job")["completed"] < len(good)  # the kills were mid-job
        results_once(tmp_path, config, "job", good)
        assert time.monotonic() - at < JOB_S
        after = wait_for(lambda: len(p := actor_pids(ray_head)) == 2 and p, "2 actors again")
        assert not after & before  # both replaced
    finally:
        ctl.stop()
        assert driver.ask("clear") == "cleared"
        driver.close()
    wait_for(lambda: not actor_pids(ray_head), "the actors to be gone")
    assert b.stop() == exitcodes.OK
    b.close()
    assert_check_clean(b.data_dir)


@pytest.mark.slow
def test_controller_killed_and_restarted_adopts_its_actors(tmp_path, ray_head):
    """...against a broker that requires CURVE keys: the fleet's own key, which only the
    controller's host has as a file, reaches the actors (they register with it)."""
    keys, authorized = tmp_path / "keys", tmp_path / "authorized_keys"
    authorized.mkdir()
    for name in ("broker", "fleet"):
        assert run_cli("keys", "new", name, "--dir", str(keys)).returncode == 0
    shutil.copy(keys / "fleet.key", authorized / "fleet.key")
    security = (
        f'[security]\nserver_key = "{keys}/broker.key_secret"\nauthorized_keys = "{authorized}"\n'
    )
    config = fleet_config(tmp_path, 2, 2, tokens_per_s=15000.0, security=security)
    ctl = Controller(tmp_path, config, ray_head.address, "adopt")
    ctl.args += ["--key", str(keys / "fleet.key_secret"), "--server-key", str(keys / "broker.key")]
    ctl.start()
    b = Broker(config)
    try:
        b.start()
        wait_for(lambda: len(sessions(b)) == 2, "both actors' workers to register", 90)
        before, registered = actor_pids(ray_head), {s["session"] for s in sessions(b)}
        good = submit(tmp_path, config, "job")
        wait_for(lambda: any(s["batches"] for s in sessions(b)), "the actors to hold batches")
        ctl.stop(signal.SIGKILL)
        ctl.start()  # a new controller, while the job runs
        killed = time.monotonic()
        results_once(tmp_path, config, "job", good)
        assert time.monotonic() - killed < JOB_S
        assert actor_pids(ray_head) == before, "an actor was started again, not adopted"
        assert {s["session"] for s in sessions(b)} == registered  # the same workers, no more
    finally:
        ctl.down()
    assert not actor_pids(ray_head)
    assert b.stop() == exitcodes.OK
    b.close()
    assert_check_clean(b.data_dir)


def test_plan_starts_lowest_free_slots_and_drains_highest_after_the_pause():
    """assembly/fleet.py's rule on a fake clock: up at once, down after scale_down_s, a
    failed slot waits FAILED_PAUSE_S, min and max bound the demand."""
    fleet = ModelFleet(build_fleet({"model": "m", "min": 1, "max": 3}), scale_down_s=10.0)
    assert fleet.plan(0, [], 0.0).start == [0]  # min = 1 even when nothing is needed
    running = [Slot(0, "running")]
    assert fleet.plan(5, running, 1.0).start == [1, 2]  # at once, up to max
    three = [Slot(0, "running"), Slot(1, "pending"), Slot(2, "running")]
    assert fleet.plan(1, three, 2.0) == Plan()  # fewer wanted: not yet
    assert fleet.plan(1, three, 11.9) == Plan()
    assert fleet.plan(1, three, 12.0).drain == [1, 2]  # 10 s later: the highest slots
    draining = [Slot(0, "running"), Slot(1, "draining"), Slot(2, "stopped")]
    plan = fleet.plan(3, draining, 13.0)
    assert plan.remove == [2] and plan.start == []  # neither draining nor removed is free
    assert fleet.plan(3, draining[:2], 14.0).start == [2]  # once gone, it is
    failed = [Slot(0, "failed")]
    assert fleet.plan(1, failed, 20.0) == Plan(start=[1], remove=[0])  # another slot starts
    assert fleet.plan(2, [Slot(1, "running")], 20.0 + FAILED_PAUSE_S - 0.1).start == [2]
    assert fleet.plan(3, [], 20.0 + FAILED_PAUSE_S - 0.1).start == [1, 2]  # 0 waits
    assert fleet.plan(3, [], 20.0 + FAILED_PAUSE_S).start == [0, 1, 2]
    fleet.plan(3, three, 30.0)  # more wanted again: the pause starts over
    assert fleet.plan(1, three, 31.0) == Plan()


def test_workers_needed_reads_the_brokers_demand():
    status = {"demand": {"m": {"workers_needed": 3, "items_pending": 10}}, "queues": []}
    assert workers_needed(status, "m") == 3
    assert workers_needed(status, "other") == 0
    queued = {"queues": [{"model": "m", "queued": 5}], "workers": []}  # a broker without demand
    assert workers_needed(queued, "m") == 1
    held = {"queues": [], "workers": [{"model": "m", "batches": 2}]}
    assert workers_needed(held, "m") == 1
    assert workers_needed({"queues": [], "workers": []}, "m") == 0


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ('[[fleet]]\nmodel = "gpt"\n', r'fleet\[0\]\.model = "gpt" names no \[\[models\]\]'),
        ("[[fleet]]\nmax = 2\n", r'fleet\[0\]\.model = "" is missing or empty'),
        (
            '[[fleet]]\nmodel = "m"\n[[fleet]]\nmodel = "m"\n',
            r'fleet\[1\]\.model = "m" repeats fleet\[0\]\.model',
        ),
        ('[[fleet]]\nmodel = "m"\nmin = 3\nmax = 2\n', r"fleet\[0\]\.min = 3 is above fleet"),
        ('[[fleet]]\nmodel = "m"\nmax = 0\n', r"fleet\[0\]\.max = 0 is below 1"),
        ('[[fleet]]\nmodel = "m"\nnum_gpus = -1\n', r"fleet\[0\]\.num_gpus = -1 is negative"),
        ('[[fleet]]\nmodel = "m"\nnum_gpu = 1\n', r"fleet\[0\]\.num_gpu = 1.*num_gpus\?"),
        ('[[fleet]]\nmodel = "m"\ncount = 2\n', r"unknown key fleet\[0\]\.count = 2"),
        ('[[fleet]]\nmodel = "m"\nengine = "gpu"\n', r'fleet\[0\]\.engine = "gpu" is not'),
    ],
)
def test_bad_fleet_tables_are_refused_naming_file_key_and_value(tmp_path, tables, message):
    path = tmp_path / "f.toml"
    path.write_text(tables + '[[models]]\nname = "m"\nengine = "echo"\n')
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(path)
    assert str(caught.value).startswith(str(path))


def test_a_fleet_table_gives_the_actors_worker_options(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text(
        '[[models]]\nname = "m"\nengine = "minilm"\n[[fleet]]\nmodel = "m"\nmax = 4\n'
        'num_gpus = 1\nnum_cpus = 2\naccelerator_type = "H100"\ndrain_s = 5\n'
        "options = {batch_size = 8}\n"
    )
    (fleet,) = load_settings(path).fleet
    assert (fleet.min, fleet.max, fleet.num_gpus, fleet.accelerator_type) == (0, 4, 1.0, "H100")
    options = WorkerOptions.of_group(fleet.worker, "m", "minilm", "", 2, "tcp://h:1", None, None)
    assert options.engine == "minilm" and options.drain_s == 5.0
    assert options.engine_options == {"threads": 2, "batch_size": 8}
    assert load_settings(tmp_path / "f.toml").workers.local == 1  # [workers] is untouched


class _NoLoad(SimulatedEngine):
    def load(self) -> None:
        raise EngineError("simulated: no such model (a test)")


def test_a_hosted_worker_runs_a_job_and_drains_as_sigterm_drains_a_worker(tmp_path):
    """gpu/worker/hosted.py without Ray: the session an actor hosts runs a job, each line
    once; drain() finishes or hands back and says BYE (the broker forgets it at once); an
    engine that cannot load fails it with exit code 10, holding nothing."""
    config = write_config(tmp_path, dispatch=FAST)
    b = Broker(config).start()
    settings = b.settings.dispatch
    options = WorkerOptions(
        settings.bind, "echo", settings.heartbeat_bind, batch_items=32, target_batch_s=0.0
    )
    hosted = HostedWorker(options, SimulatedEngine(tokens_per_s=30000.0))
    try:
        wait_for(lambda: sessions(b), "the hosted worker to register")
        assert hosted.state()["state"] == "running"
        good = submit(tmp_path, config, "job", 600)
        wait_for(lambda: any(s["batches"] for s in sessions(b)), "it to hold batches")
        assert hosted.drain() == "draining"  # mid-job: it finishes its batch, hands back
        wait_for(lambda: hosted.state()["state"] == "stopped", "the drain to end", 30)
        assert hosted.state()["exit_code"] == exitcodes.OK
        wait_for(lambda: not sessions(b), "the broker to forget the session (its BYE)", 5)
        second = HostedWorker(options, SimulatedEngine(tokens_per_s=300000.0))
        results_once(tmp_path, config, "job", good)  # what it handed back went to the next
        second.drain()
        wait_for(lambda: second.state()["state"] == "stopped", "the second drain to end", 30)
        broken = HostedWorker(options, _NoLoad())
        wait_for(lambda: broken.state()["state"] == "failed", "the engine's failure")
        assert broken.state()["exit_code"] == exitcodes.ENGINE_CANNOT_START
    finally:
        hosted.drain()
    assert b.stop() == exitcodes.OK
    b.close()
    assert_check_clean(b.data_dir)
