"""The back half with real processes: workers, dispatch and completion under kills.

Every test submits a real job, lets real workers (local ones started by the
supervisor, or `run.py worker` processes) work through it while something is
killed, fetches the results with `run.py results`, and checks that each
custom_id appears exactly once across the output and error files; then it
stops the broker and runs the project's consistency check.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zygote
from broker import REPO, Broker, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from collector.results_client import DispatchClient
from gpu.worker.options import WorkerOptions
from pipeline.core import exitcodes
from pipeline.process.supervisor_report import read_report

FAST = """lease_s = 6.0
session_timeout_s = 2.0
reregister_grace_s = 1.0
report_s = 0.3
max_attempts = 3"""
# A worker that takes over from a `simulated` one must run the same engine: completion learns
# an embedding model's dimension from its first result (384 from `simulated`), and hands back
# what `echo` (64 values in lane 64) sends for the same model, until each item is an error.
TAKE_OVER = ("simulated", "tokens_per_s=1000000")


@pytest.fixture
def broker(tmp_path):
    started = []

    def start(
        workers: int = 1,
        dispatch: str = FAST,
        worker_keys: str = "",
        edit=None,
    ) -> Broker:
        """`edit`: a function of the config text that returns the text to start with."""
        config = write_config(tmp_path, workers=workers, dispatch=dispatch, worker_keys=worker_keys)
        if edit is not None:
            config.write_text(edit(config.read_text()))
        b = Broker(config)
        b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


@pytest.fixture
def workers():
    procs: list[subprocess.Popen] = []

    def start(b: Broker, engine: str = "echo", *options: str, **kw):
        worker = WorkerOptions(
            broker=b.settings.dispatch.bind,
            model="echo",
            heartbeat=b.settings.dispatch.heartbeat_bind,
            engine=engine,
            batch_items=kw.get("batch_items", 64),
            prefetch=kw.get("prefetch", 2),
            drain_s=kw.get("drain_s", 10),
            target_batch_s=0,  # the batch sizes these tests ask for, not ones measured
            fault=kw.get("fault", ""),  # gpu/worker/faults.py
        )
        args = [sys.executable, str(REPO / "run.py"), "worker", *worker.argv()]
        for option in options:
            args += ["--option", option]
        proc = zygote.Popen(
            args,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stderr.close()


def cli(b: Broker, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`python run.py ARGS --config <the broker's>`, captured (run in this process:
    tests/client_commands.py; `timeout_s` is the old subprocess bound, unused)."""
    return run_cli(*args, "--config", str(b.config))


def job_info(b: Broker, job: str) -> dict:
    """What `run.py status JOB --json` prints (asked in-process: tests poll it)."""
    return b.job_status(job)


def fetch(b: Broker, job: str, out: Path, *args: str, timeout_s: float = 120):
    return cli(b, "results", job, "-o", str(out), *args, timeout_s=timeout_s)


def delivered(out: Path) -> Counter:
    """custom_id (or id, when it had none) -> lines, across the output and error files."""
    counts: Counter = Counter()
    for path in (out, Path(f"{out}.errors.jsonl")):
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                counts[record["custom_id"] or record["id"]] += 1
    return counts


def assert_each_once(out: Path, n: int) -> None:
    counts = delivered(out)
    twice = [k for k, c in counts.items() if c > 1]
    assert not twice, f"{len(twice)} custom_ids delivered twice, e.g. {twice[:5]}"
    assert len(counts) == n, f"{len(counts)} of {n} lines have a result"


def submit_job(b: Broker, tmp_path: Path, n: int, job: str, **kw) -> Path:
    data = tmp_path / f"{job}.jsonl"
    write_jsonl(data, n, **kw)
    result = submit(b.config, data, "--job-id", job)
    assert result.returncode == 0, result.stderr
    return data


def finished(b: Broker, job: str) -> bool:
    return job_info(b, job)["state"] in ("completed", "cancelled")


def finishes_once_computed_once(b: Broker, tmp_path: Path, job: str, n: int, timeout_s: float):
    """`job` finishes within `timeout_s`, its `n` lines are delivered once each, and no item
    ran twice (a resend of an unacknowledged result is not a computation)."""
    wait_for(lambda: finished(b, job), f"job {job} to finish", timeout_s=timeout_s)
    out = tmp_path / f"{job}.out.jsonl"
    assert fetch(b, job, out).returncode == 0
    assert_each_once(out, n)
    assert b.metric("fabric_duplicate_results_total", why="computed_again") == 0


def stop_and_check(b: Broker) -> None:
    assert b.stop() == exitcodes.OK, b.stderr
    assert_check_clean(b.data_dir)


def test_local_workers_finish_a_job_and_results_arrive_once_with_its_errors(tmp_path, broker):
    b = broker(workers=2)
    submit_job(b, tmp_path, 2000, "j", bad_every=97)
    out = tmp_path / "out.jsonl"
    result = fetch(b, "j", out, "--follow")
    assert result.returncode == 0, result.stderr
    assert "state completed" in result.stderr
    assert_each_once(out, 2000)
    errors = Path(f"{out}.errors.jsonl").read_text().splitlines()
    assert len(errors) == 2000 // 97 and all("invalid_json" in e for e in errors)
    info = job_info(b, "j")
    assert (info["total"], info["completed"], info["failed"], info["pending"]) == (
        2000,
        2000 - 2000 // 97,
        2000 // 97,
        0,
    )
    again = fetch(b, "j", out)  # everything was delivered: nothing is written twice
    assert again.returncode == 0 and "0 results" in again.stderr
    refetch = fetch(b, "j", tmp_path / "all.jsonl", "--all")
    assert refetch.returncode == 0, refetch.stderr
    assert_each_once(tmp_path / "all.jsonl", 2000)
    stop_and_check(b)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["before_compute", "mid_batch", "before_send", "before_ack"])
def test_a_worker_killed_at_each_phase_loses_and_doubles_nothing(tmp_path, broker, workers, phase):
    b = broker(workers=0)
    submit_job(b, tmp_path, 1500, "k")
    doomed = workers(b, fault=f"{phase}:3")
    wait_for(lambda: doomed.poll() is not None, f"the worker to die {phase}", timeout_s=60)
    assert doomed.returncode == -signal.SIGKILL
    workers(b)  # a healthy one finishes the job, after the dead session's items are reclaimed
    wait_for(lambda: finished(b, "k"), "the job to finish", timeout_s=90)
    out = tmp_path / "out.jsonl"
    assert fetch(b, "k", out).returncode == 0
    assert_each_once(out, 1500)
    wait_for(  # the dead session is declared gone (it may end after the job did)
        lambda: b.metric("fabric_worker_sessions") == 1, "the dead session to be dropped"
    )
    stop_and_check(b)


@pytest.mark.slow
@pytest.mark.timeout(240)  # the job runs about 25 s on purpose: it must still run at the kill
def test_broker_sigkilled_while_a_fleet_holds_batches_all_re_register(tmp_path, broker, workers):
    b = broker(
        workers=0, dispatch=FAST.replace("reregister_grace_s = 1.0", "reregister_grace_s = 3.0")
    )
    submit_job(b, tmp_path, 1200, "r")
    fleet = [
        workers(b, "simulated", "tokens_per_s=5000", batch_items=32, prefetch=3) for _ in range(3)
    ]
    wait_for(lambda: b.metric("fabric_worker_sessions") == 3, "the fleet to register")
    wait_for(lambda: job_info(b, "r")["completed"] > 100, "some progress")
    b.kill()  # the whole broker, with batches out
    b.start()
    with DispatchClient(b.settings.dispatch.bind, timeout_s=10) as dispatch:
        wait_for(
            lambda: dispatch.broker_status()["registered_holding"] == 3,
            "the whole fleet to re-register with what it holds",
        )
    assert all(w.poll() is None for w in fleet)  # the workers lived through it
    finishes_once_computed_once(b, tmp_path, "r", 1200, timeout_s=120)
    stop_and_check(b)


@pytest.mark.slow
def test_a_dead_letter_completion_never_stored_is_sent_again_after_completion_is_killed(
    tmp_path, broker
):
    """Invariants 3 and 14: dispatch sends a dead letter once; completion, stopped, never reads
    it and is SIGKILLed. Dispatch sends it again until completion retires it."""
    data = tmp_path / "d.jsonl"
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "echo", "prompt_token_ids": [666, 7, 8]},
        }
        for i in range(1)  # alone: with completion stopped, no other result could be taken
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    b = broker(workers=1, worker_keys="options = {poison_token = 666}")  # the echo engine's
    completion = b.pids()["completion-0"]
    os.kill(completion, signal.SIGSTOP)  # it takes nothing in from here on
    assert submit(b.config, data, "--job-id", "d").returncode == 0
    wait_for(
        lambda: b.metric("fabric_dead_letters_total") >= 1,
        "the poison item to be dead-lettered (its ITEM_ERRORS sent to the stopped completion)",
        timeout_s=60,
    )
    os.kill(completion, signal.SIGKILL)  # what it had not read dies with it
    # Whether the kill took the sent message (then dispatch sends it again after 5 s) or it was
    # still in dispatch's queue (then the new completion gets it), the job must finish.
    wait_for(lambda: finished(b, "d"), "the job to finish after the dead letter is resent", 90)
    out = tmp_path / "out.jsonl"
    assert fetch(b, "d", out).returncode == 0
    assert not out.read_text()
    errors = [json.loads(e) for e in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c0", "dead_lettered")]
    stop_and_check(b)


def test_a_stopped_worker_loses_its_work_and_resumes_without_doubling(tmp_path, broker, workers):
    b = broker(workers=0)
    submit_job(b, tmp_path, 800, "s")
    stopped = workers(b, "simulated", "tokens_per_s=20000", batch_items=16)
    wait_for(lambda: job_info(b, "s")["completed"] > 20, "some progress")
    stopped.send_signal(signal.SIGSTOP)
    wait_for(
        lambda: b.metric("fabric_items_reclaimed_total", cause="session_lost") > 0,
        "the silent session to be reclaimed",
    )
    workers(b, *TAKE_OVER)  # another worker does the reclaimed items
    wait_for(lambda: finished(b, "s"), "the job to finish", timeout_s=90)
    assert job_info(b, "s")["completed"] == 800  # every item computed, none refused
    stopped.send_signal(signal.SIGCONT)
    wait_for(lambda: b.metric("fabric_worker_sessions") == 2, "it to re-register")
    out = tmp_path / "out.jsonl"
    assert fetch(b, "s", out).returncode == 0
    assert_each_once(out, 800)
    stop_and_check(b)


@pytest.mark.slow
def test_dispatch_sigkilled_alone_reloads_its_file_and_workers_keep_their_batches(
    tmp_path, broker, workers
):
    b = broker(workers=0)
    submit_job(b, tmp_path, 1000, "d")
    workers(b, "simulated", "tokens_per_s=20000", batch_items=32, prefetch=3)
    wait_for(lambda: job_info(b, "d")["completed"] > 50, "some progress")
    b.kill_stage("dispatch-0")
    wait_for(lambda: b.broker_status()["reloaded_leases"] > 0, "dispatch to reload its file")
    wait_for(lambda: finished(b, "d"), "the job to finish", timeout_s=90)
    out = tmp_path / "out.jsonl"
    assert fetch(b, "d", out).returncode == 0
    assert_each_once(out, 1000)
    stop_and_check(b)


def test_sigterm_drains_a_worker_and_nothing_waits_for_a_lease(tmp_path, broker, workers):
    b = broker(
        workers=0,
        dispatch=FAST.replace("lease_s = 6.0", "lease_s = 300.0").replace(
            "session_timeout_s = 2.0", "session_timeout_s = 300.0"
        ),
    )
    submit_job(b, tmp_path, 600, "t")
    first = workers(b, "simulated", "tokens_per_s=5000", batch_items=16, prefetch=4)
    wait_for(lambda: job_info(b, "t")["completed"] > 10, "some progress")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    assert "handed back" in first.stderr.read()
    workers(b, *TAKE_OVER)  # finishes at once: nothing waits for a 300 s lease
    wait_for(lambda: finished(b, "t"), "the job to finish without lease expiry", timeout_s=60)
    assert job_info(b, "t")["completed"] == 600
    out = tmp_path / "out.jsonl"
    assert fetch(b, "t", out).returncode == 0
    assert_each_once(out, 600)
    stop_and_check(b)


@pytest.mark.slow
def test_sigterm_to_the_broker_mid_job_drains_its_local_worker_and_the_next_life_finishes_once(
    tmp_path, broker
):
    """Invariant 15 through the broker's own stop. Every stage's wait ends with the signal
    (pipeline/process/stage.py), so the local worker drains at once: it finishes its running batch and
    hands back the rest while dispatch and completion still run. No stage waits for its stop
    timeout to be killed; the data dir checks clean; the next life finishes the job with each
    line once and nothing computed twice."""
    b = broker(workers=1, worker_keys='engine = "simulated"\noptions = {tokens_per_s = 20000.0}')
    submit_job(b, tmp_path, 600, "t")
    wait_for(lambda: job_info(b, "t")["completed"] > 50, "some progress")
    asked = time.monotonic()
    assert b.stop() == exitcodes.OK, b.stderr
    took = time.monotonic() - asked
    stage_exits = {s["stage"]: s["last_exit"] for s in read_report(b.data_dir.root)["stages"]}
    assert set(stage_exits.values()) == {"exit code 0"}, stage_exits  # none killed
    assert took < b.settings.supervisor.stop_timeout_s, f"the stop took {took:.1f} s"
    assert_check_clean(b.data_dir)
    b.start()
    finishes_once_computed_once(b, tmp_path, "t", 600, timeout_s=60)
    stop_and_check(b)


def test_a_late_result_after_lease_expiry_is_dropped_once_another_attempt_won(
    tmp_path, broker, workers
):
    slow_reports = (
        FAST.replace("report_s = 0.3", "report_s = 30.0")
        .replace("lease_s = 6.0", "lease_s = 1.0")
        .replace("session_timeout_s = 2.0", "session_timeout_s = 60.0")
    )
    b = broker(workers=0, dispatch=slow_reports)
    submit_job(b, tmp_path, 200, "l")
    workers(
        b, "simulated", "tokens_per_s=2000", batch_items=100, prefetch=1
    )  # slower than its lease
    wait_for(
        lambda: b.metric("fabric_items_reclaimed_total", cause="lease_expired") > 0,
        "a lease to expire mid-compute",
    )
    workers(b, *TAKE_OVER)
    wait_for(lambda: finished(b, "l"), "the job to finish", timeout_s=90)
    assert job_info(b, "l")["completed"] == 200
    out = tmp_path / "out.jsonl"
    assert fetch(b, "l", out).returncode == 0
    assert_each_once(out, 200)
    stop_and_check(b)


@pytest.mark.slow
def test_completion_sigkilled_mid_stream_keeps_one_result_and_one_tombstone_each(tmp_path, broker):
    b = broker(workers=2)
    submit_job(b, tmp_path, 3000, "c")
    for _ in range(3):
        wait_for(lambda: job_info(b, "c")["completed"] > 0, "progress")
        b.kill_stage("completion-0")
    wait_for(lambda: finished(b, "c"), "the job to finish", timeout_s=90)
    out = tmp_path / "out.jsonl"
    assert fetch(b, "c", out).returncode == 0
    assert_each_once(out, 3000)
    stop_and_check(b)


@pytest.mark.slow
def test_results_client_killed_mid_stream_then_rerun_writes_each_id_once(tmp_path, broker):
    b = broker(workers=2)
    submit_job(b, tmp_path, 4000, "x")
    wait_for(lambda: finished(b, "x"), "the job to finish", timeout_s=90)
    out = tmp_path / "out.jsonl"
    for _ in range(3):
        client = subprocess.Popen(
            [sys.executable, "run.py", "results", "x", "-o", str(out), "--config", str(b.config)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda c=client: (out.exists() and out.stat().st_size > 0) or c.poll() is not None,
            "output",
        )
        client.kill()
        client.wait(timeout=10)
    assert fetch(b, "x", out).returncode == 0
    assert_each_once(out, 4000)
    stop_and_check(b)


@pytest.mark.slow
def test_results_follow_survives_a_broker_restart(tmp_path, broker):
    b = broker(workers=0)
    submit_job(b, tmp_path, 500, "f")
    out = tmp_path / "out.jsonl"
    client = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "results",
            "f",
            "-o",
            str(out),
            "--follow",
            "--config",
            str(b.config),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    b.kill()
    config = b.config.read_text().replace("local = 0", "local = 1")
    b.config.write_text(config)
    b.__init__(b.config)
    b.start()
    _, err = client.communicate(timeout=120)
    assert client.returncode == 0, err
    assert_each_once(out, 500)
    stop_and_check(b)


def test_cancel_retires_queued_items_as_cancelled_with_honest_counts(tmp_path, broker):
    b = broker(workers=0)
    submit_job(b, tmp_path, 700, "z")
    result = cli(b, "cancel", "z", timeout_s=60)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: job_info(b, "z")["state"] == "cancelled", "the job to end cancelled")
    info = job_info(b, "z")
    assert (info["completed"], info["failed"], info["pending"]) == (0, 700, 0)
    out = tmp_path / "out.jsonl"
    assert fetch(b, "z", out).returncode == 0
    assert_each_once(out, 700)
    codes = {
        json.loads(e)["error"]["code"] for e in Path(f"{out}.errors.jsonl").read_text().splitlines()
    }
    assert codes == {"cancelled"}
    stop_and_check(b)


def test_cancelled_items_leave_the_queue_count_and_stay_out_once_retired(tmp_path, broker):
    """Issue 30 point 9: the cancelled items left the queue count when cancelled, and came
    back into it once completion retired them (RETIRED cleared their `out` flags), so two
    cancelled jobs went on being shown queued. Both jobs share segments; no worker takes work,
    so every item of the other job stays queued, and the count must be exactly those."""
    b = broker(workers=0)

    def queued() -> tuple[int, float]:
        """(the status answer's queued items, the fabric_queued_items metric)."""
        status = sum(q["queued"] for q in b.broker_status()["queues"])
        return status, b.metric("fabric_queued_items")

    submit_job(b, tmp_path, 300, "keep")
    submit_job(b, tmp_path, 300, "drop")
    wait_for(lambda: queued() == (600, 600), "both jobs to be counted queued", timeout_s=30)
    assert cli(b, "cancel", "drop").returncode == 0
    wait_for(lambda: job_info(b, "drop")["state"] == "cancelled", "the job to end cancelled")
    wait_for(  # dispatch has had completion's RETIRED for every cancelled item
        lambda: b.broker_status()["unretired_item_errors"] == 0,
        "the cancelled items to be retired",
        timeout_s=30,
    )
    wait_for(lambda: queued() == (300, 300), "only job keep to be counted", timeout_s=15)
    assert job_info(b, "keep")["pending"] == 300
    assert b.stop() == exitcodes.OK, b.stderr
    b = Broker(b.config).start()  # the next life finds the cancelled items DEAD on disk
    try:
        wait_for(lambda: queued() == (300, 300), "only job keep to be counted", timeout_s=15)
    finally:
        stop_and_check(b)


def test_delivered_results_expire_after_retention_and_finished_inputs_are_collected(
    tmp_path, broker
):
    def expire_at_once(config: str) -> str:
        config = config.replace("[completion]\n", "[completion]\nresults_retention_s = 0.0\n")
        config = config.replace("[broker]\n", "[broker]\nsegment_idle_s = 0.5\n")
        return config + "\n[collector]\ninterval_s = 0.3\n"

    b = broker(workers=1, edit=expire_at_once)
    submit_job(b, tmp_path, 400, "e")
    out = tmp_path / "out.jsonl"
    assert fetch(b, "e", out, "--follow").returncode == 0
    assert_each_once(out, 400)
    wait_for(lambda: job_info(b, "e")["state"] == "expired", "the job to expire")
    wait_for(lambda: not list(b.data_dir.completion.glob("out-*.seg")), "results to be removed")
    wait_for(lambda: not list(b.data_dir.segments.glob("in-*.seg")), "inputs to be collected")
    again = fetch(b, "e", tmp_path / "late.jsonl")
    assert again.returncode == 0 and "state expired" in again.stderr
    stop_and_check(b)


def test_the_heartbeat_port_answers_while_dispatch_restarts(tmp_path, broker):
    import zmq

    from pipeline.transport import wire

    b = broker(workers=0)
    context = zmq.Context()
    ping = context.socket(zmq.DEALER)
    ping.setsockopt(zmq.LINGER, 0)
    ping.connect(b.settings.dispatch.heartbeat_bind)
    try:
        os.kill(b.pids()["dispatch-0"], signal.SIGKILL)
        wire.send(ping, wire.MessageType.PING, {})
        pong = wire.recv(ping, 5000)
        assert pong is not None and pong.type == wire.MessageType.PONG
        assert pong.meta["recovered"] is True and pong.meta["epoch"] > 0
        wait_for(b.all_up, "dispatch to be restarted")
    finally:
        ping.close(0)
        context.term()
    stop_and_check(b)
