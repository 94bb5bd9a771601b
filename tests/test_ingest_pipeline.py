"""The front half with real processes: submit-and-walk-away, kills, hostile frames."""

from __future__ import annotations

import json
import threading

import pytest
import zmq
from broker import Broker, seq_counts, submit, write_config, write_jsonl
from conftest import assert_check_clean, small_tmpfs, wait_for

from pipeline.core import exitcodes
from pipeline.transport import wire

# A chunk that a killed stage took with it is sent again after 4 s (--timeout), up to 20 tries:
# 80 s of patience in all, as 10 tries of 8 s were, with less of it spent waiting on each loss.
KILLED_STAGE_PATIENCE = ("--chunk-lines", "100", "--timeout", "4", "--attempts", "20")


def job_no(broker: Broker, job_id: str) -> int:
    return json.loads((broker.data_dir.root / "jobs" / job_id / "job.json").read_text())["job_no"]


def assert_exactly_once(broker: Broker, job_id: str, good: set[int]) -> None:
    counts = seq_counts(broker.data_dir)
    base = job_no(broker, job_id) << 32
    missing = [i for i in good if counts[base | i] == 0]
    twice = [i for i in good if counts[base | i] > 1]
    assert not missing, f"{len(missing)} acknowledged items are missing, e.g. {missing[:5]}"
    assert not twice, f"{len(twice)} items are stored twice, e.g. {twice[:5]}"
    extra = [s for s in counts if s >> 32 == base >> 32 and (s & 0xFFFFFFFF) not in good]
    assert not extra, f"items that were never valid are stored: {extra[:5]}"


@pytest.fixture
def broker(tmp_path):
    started = []

    def start(config=None) -> Broker:
        b = Broker(config or write_config(tmp_path)).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


def test_submit_and_walk_away_then_stop_cleanly(tmp_path, broker):
    b = broker()
    data = tmp_path / "in.jsonl"
    good = write_jsonl(data, 1500, bad_every=100, text_every=3)
    result = submit(b.config, data, "--job-id", "walk")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "walk"
    rejected = 1500 - len(good)
    assert f"{len(good)} items queued, {rejected} lines rejected" in result.stderr
    errors = (tmp_path / "in.jsonl.errors.jsonl").read_text().splitlines()
    codes = sorted({json.loads(e)["error"]["code"] for e in errors})
    assert len(errors) == rejected and codes == ["invalid_json", "prompt_too_long"]
    assert_exactly_once(b, "walk", good)
    again = submit(b.config, data, "--job-id", "walk")  # a lost acknowledgement, retried
    assert again.returncode == 0, again.stderr
    assert_exactly_once(b, "walk", good)
    assert b.stop() == exitcodes.OK
    stopped = {s["stage"]: (s["state"], s["last_exit"]) for s in b.report()["stages"]}
    for label in ("front-0", "tokenizer-0", "router-0", "writer-0"):
        assert stopped[label] == ("stopped", "exit code 0")
    assert_check_clean(b.data_dir)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["front-0", "router-0", "writer-0", "tokenizer-0"])
def test_sigkill_a_stage_mid_submit_loses_and_duplicates_nothing(tmp_path, broker, stage):
    b = broker()
    data = tmp_path / "in.jsonl"
    good = write_jsonl(data, 6000, seed=3, text_every=2)
    outcome = {}

    def run() -> None:
        outcome["result"] = submit(b.config, data, "--job-id", "killed", *KILLED_STAGE_PATIENCE)

    thread = threading.Thread(target=run)
    thread.start()
    chunks = b.data_dir.root / "jobs" / "killed" / "chunks.log"
    wait_for(
        lambda: chunks.exists() and chunks.stat().st_size > 20_000, "some chunks to be committed"
    )
    b.kill_stage(stage)
    thread.join(timeout=180)
    result = outcome["result"]
    assert result.returncode == 0, result.stderr
    assert_exactly_once(b, "killed", good)
    assert (stage, "signal SIGKILL") in [(d["stage"], d["how"]) for d in b.report()["deaths"]]
    assert b.stop() == exitcodes.OK
    assert_check_clean(b.data_dir)


@pytest.mark.slow
def test_sigkill_the_whole_broker_then_resubmit_stores_each_item_once(tmp_path, broker):
    config = write_config(tmp_path)
    b = broker(config)
    data = tmp_path / "in.jsonl"
    good = write_jsonl(data, 6000, seed=4)
    outcome = {}

    def run() -> None:
        outcome["result"] = submit(
            config, data, "--job-id", "crash", "--chunk-lines", "100", "--timeout", "2"
        )

    thread = threading.Thread(target=run)
    thread.start()
    chunks = b.data_dir.root / "jobs" / "crash" / "chunks.log"
    wait_for(
        lambda: chunks.exists() and chunks.stat().st_size > 20_000, "some chunks to be committed"
    )
    b.kill()
    thread.join(timeout=180)
    assert outcome["result"].returncode == exitcodes.UNAVAILABLE, outcome["result"].stderr
    assert "--job-id crash to resume" in outcome["result"].stderr
    b2 = broker(config)  # up: its supervisor ran recovery before it started any stage
    result = submit(config, data, "--job-id", "crash", "--chunk-lines", "100")
    assert result.returncode == 0, result.stderr
    assert_exactly_once(b2, "crash", good)
    assert b2.stop() == exitcodes.OK
    assert_check_clean(b2.data_dir)


def test_garbage_frames_are_dropped_and_the_front_keeps_serving(tmp_path, broker):
    b = broker()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(b.address)
    try:
        sock.send_multipart([b"garbage"])
        assert b"malformed" in sock.recv_multipart()[0]
        sock.send_multipart([wire.MAGIC + bytes(12), b"x" * 100])  # lying header
        assert b"malformed" in sock.recv_multipart()[0]
        sock.send_multipart([wire.MAGIC + b"\x63\x00" + bytes(10)])  # unknown type
        sock.recv_multipart()
    finally:
        sock.close(0)
    big = context.socket(zmq.DEALER)  # over max_message_bytes: the front drops the peer
    big.setsockopt(zmq.LINGER, 0)
    big.connect(b.address)
    big.send(b"x" * (70 << 20))
    big.close(0)
    context.term()
    data = tmp_path / "in.jsonl"
    good = write_jsonl(data, 300, seed=5)
    result = submit(b.config, data, "--job-id", "after-garbage")
    assert result.returncode == 0, result.stderr
    assert_exactly_once(b, "after-garbage", good)
    assert "dropped a malformed message" in (b.data_dir.log / "front-0.log").read_text()
    assert b.stop() == exitcodes.OK


def test_full_disk_gives_producers_a_retryable_error_and_resumes_once_freed(tmp_path, broker):
    with small_tmpfs(tmp_path / "small", "24m") as mount:
        config = (
            write_config(tmp_path).read_text().replace(str(tmp_path / "data"), str(mount / "data"))
        )
        path = tmp_path / "small.toml"
        path.write_text(config)
        b = broker(path)
        filler = mount / "filler"
        filler.write_bytes(bytes(12 << 20))
        data = tmp_path / "in.jsonl"
        good = write_jsonl(data, 12000, seed=6)  # about 12 MB of slots: more than is free
        first = submit(path, data, "--job-id", "full", "--timeout", "5", "--attempts", "3")
        assert first.returncode == exitcodes.UNAVAILABLE, first.stderr
        assert "disk full" in first.stderr and "--job-id full to resume" in first.stderr
        filler.unlink()
        second = submit(path, data, "--job-id", "full")
        assert second.returncode == 0, second.stderr
        assert_exactly_once(b, "full", good)
        assert b.stop() == exitcodes.OK
        assert_check_clean(b.data_dir)


def test_several_tokenizers_routers_and_writers_share_the_work(tmp_path, broker):
    b = broker(write_config(tmp_path, tokenizers=2, routers=2, writers=2))
    data = tmp_path / "in.jsonl"
    good = write_jsonl(data, 4000, seed=7, text_every=2)  # lengths across 4 lanes, text and ids
    result = submit(b.config, data, "--job-id", "wide", "--chunk-lines", "100")
    assert result.returncode == 0, result.stderr
    assert_exactly_once(b, "wide", good)

    def appended() -> dict[str, float]:
        return {w: b.metric("fabric_writer_items_appended_total", writer=w) for w in "01"}

    wait_for(lambda: sum(appended().values()) == len(good), "both writers' reports")
    assert all(appended().values()), f"a writer appended nothing: {appended()}"
    assert b.stop() == exitcodes.OK
    # Too little data to rotate a segment: two writers on one key would show as two files.
    keys = [p.name.split(".", 1)[1] for p in b.data_dir.segment_files()]
    assert len(keys) == len(set(keys))
    assert_check_clean(b.data_dir)


@pytest.mark.slow
def test_concurrent_producers_with_a_writer_killed_each_get_their_job_exactly_once(
    tmp_path, broker
):
    b = broker()
    jobs = {}
    for n in range(3):
        data = tmp_path / f"in-{n}.jsonl"
        jobs[f"par-{n}"] = (data, write_jsonl(data, 3000, seed=10 + n, bad_every=97, text_every=3))
    outcomes = {}

    def run(job_id: str, data) -> None:
        outcomes[job_id] = submit(b.config, data, "--job-id", job_id, *KILLED_STAGE_PATIENCE)

    threads = [
        threading.Thread(target=run, args=(job_id, data)) for job_id, (data, _) in jobs.items()
    ]
    for thread in threads:
        thread.start()
    chunks = b.data_dir.root / "jobs" / "par-0" / "chunks.log"
    wait_for(lambda: chunks.exists() and chunks.stat().st_size > 10_000, "the jobs to be under way")
    b.kill_stage("writer-0")
    for thread in threads:
        thread.join(timeout=180)
    for job_id, (_, good) in jobs.items():
        assert outcomes[job_id].returncode == 0, outcomes[job_id].stderr
        assert_exactly_once(b, job_id, good)
    assert b.stop() == exitcodes.OK
    assert_check_clean(b.data_dir)


def test_submit_without_a_broker_says_so_quickly(tmp_path):
    config = write_config(tmp_path)
    data = tmp_path / "in.jsonl"
    write_jsonl(data, 10)
    result = submit(config, data, "--timeout", "1", timeout_s=60)
    assert result.returncode == exitcodes.UNAVAILABLE
    assert (
        "no broker answers at tcp://127.0.0.1:" in result.stderr
        and "is it running?" in result.stderr
    )


def test_strict_submit_refuses_the_whole_file_before_anything_is_queued(tmp_path, broker):
    b = broker()
    data = tmp_path / "in.jsonl"
    write_jsonl(data, 500, bad_every=250)
    result = submit(b.config, data, "--job-id", "strict", "--strict")
    assert result.returncode == exitcodes.FAILED
    assert "line 250" in result.stderr and "strict mode refuses the whole file" in result.stderr
    assert not (b.data_dir.root / "jobs" / "strict").exists()
    assert not list(b.data_dir.segments.glob("in-*.seg"))
    assert b.stop() == exitcodes.OK
