"""Damage to the input log, with real processes: one damaged file never stops the broker,
and an acknowledged item that rot destroyed ends as a `corrupt_input` error, never silently.

Each test queues a job on a broker without workers, stops it, damages real segment files,
then restarts the broker with a worker (or runs `run.py check` first) and waits for the
job to end: intact items have results, lost ones `corrupt_input` error lines, each
custom_id exactly once; the broker exits 0 and the consistency check passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from broker import Broker, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, wait_for

from pipeline.core import exitcodes
from pipeline.core.errors import FabricError
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, EMPTY, LIVE

# Three broker lives per test (queue, restart, stop): more than the suite's default 120 s
# on a loaded machine.
pytestmark = pytest.mark.timeout(300)
JOB_END_S = 60  # the job ends within this after the restart (a few hundred echo items)


def cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    """`run.py ARGS --config CONFIG`, run in this process (tests/client_commands.py)."""
    return run_cli(*args, "--config", str(config))


@pytest.fixture(scope="module")
def queued_template(tmp_path_factory) -> tuple[Path, set[int]]:
    """The data dir of a stopped broker whose input log holds job `d` (400 lines, all
    acknowledged), made by a real broker once per module; each test damages its own copy."""
    tmp_path = tmp_path_factory.mktemp("queued")
    b = Broker(write_config(tmp_path, workers=0)).start()
    try:
        data = tmp_path / "d.jsonl"
        stored = write_jsonl(data, 400)
        result = submit(b.config, data, "--job-id", "d")
        assert result.returncode == 0, result.stderr
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        b.close()
    return b.data_dir.root, stored


@pytest.fixture
def queued_job(tmp_path, queued_template) -> tuple[Broker, set[int]]:
    """A stopped broker (never started here) on a copy of the template's data dir."""
    template, stored = queued_template
    shutil.copytree(template, tmp_path / "data", symlinks=True)
    return Broker(write_config(tmp_path, workers=0)), stored


def segments_by_size(b: Broker) -> list[tuple[Path, np.ndarray, np.ndarray]]:
    """(path, live slots, their item indexes) of each input segment, most items first."""
    found = []
    for path in sorted(b.data_dir.segments.glob("in-*.seg")):
        with Segment.open(path) as seg:
            live = np.flatnonzero(seg.states() == LIVE)
            index = (seg.slots["seq"][live] & np.uint64(0xFFFFFFFF)).astype(np.int64)
            found.append((path, live, index))
    return sorted(found, key=lambda f: -len(f[1]))


def restart_and_finish(tmp_path: Path, b: Broker) -> Broker:
    """Restart with one worker and wait for job `d` to end; the broker must keep running."""
    b.close()
    again = Broker(write_config(tmp_path, workers=1)).start()
    wait_for(
        lambda: again.proc.poll() is not None or job_state(again) == "completed",
        "the job to end",
        timeout_s=JOB_END_S,
    )
    assert again.proc.poll() is None, f"the broker exited with {again.proc.returncode}"
    return again


def job_state(b: Broker) -> str:
    """Job d's state, "?" while the broker cannot say (it may be restarting)."""
    try:
        return b.job_status("d")["state"]
    except FabricError:
        return "?"


def delivered(b: Broker, tmp_path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """custom_id -> lines across results and errors, and custom_id -> error code."""
    out = tmp_path / "out.jsonl"
    result = cli(b.config, "results", "d", "-o", str(out))
    assert result.returncode == 0, result.stderr
    counts: dict[str, int] = {}
    codes: dict[str, str] = {}
    for path in (out, Path(f"{out}.errors.jsonl")):
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            counts[record["custom_id"]] = counts.get(record["custom_id"], 0) + 1
            if record["error"]:
                codes[record["custom_id"]] = record["error"]["code"]
    return counts, codes


def test_a_damaged_segment_is_isolated_and_everything_else_is_served(tmp_path, queued_job):
    b, stored = queued_job
    segments = segments_by_size(b)
    assert len(segments) >= 3, "the job should spread over several lanes"
    (cut_path, cut_live, cut_index), (flip_path, _, _) = segments[0], segments[1]
    with Segment.open(cut_path) as seg:
        slot_bytes, slots_offset = seg.header.slot_bytes, seg.header.slots_offset
    keep = len(cut_live) // 2  # truncated in the middle of the slot after these
    os.truncate(cut_path, slots_offset + int(cut_live[keep]) * slot_bytes + slot_bytes // 2)
    lost = {f"r{i}" for i in cut_index[keep:].tolist()}
    with open(flip_path, "r+b") as f:  # a flipped header byte (created_ns): checksum fails
        f.seek(41)
        byte = f.read(1)
        f.seek(41)
        f.write(bytes([byte[0] ^ 0x20]))

    again = restart_and_finish(tmp_path, b)
    counts, codes = delivered(again, tmp_path)
    assert set(counts) == {f"r{i}" for i in stored} and set(counts.values()) == {1}
    assert codes == dict.fromkeys(lost, "corrupt_input")
    status = json.loads(cli(again.config, "status", "--json").stdout)
    assert sorted(status["damaged_segments"]) == sorted([cut_path.name, flip_path.name])
    url = f"http://{again.settings.metrics.bind}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert "fabric_damaged_segments 2" in response.read().decode()
    assert again.stop() == exitcodes.OK, again.stderr
    check = cli(again.config, "check")
    assert check.returncode == 0, check.stdout
    assert check.stdout.count("note: ") == 2 and "isolated" in check.stdout
    assert_check_clean(again.data_dir)
    again.close()


def test_a_flipped_byte_of_the_model_name_in_a_header_leaves_every_item_served(
    tmp_path, queued_job
):
    """Issue 30 point 6: a flipped letter of the header's model name ("echo", bytes 48..51)
    or of its NUL padding (52..111) made every item of its segment a corrupt_input error;
    the file name spells the model, so they are all served."""
    b, stored = queued_job
    segments = segments_by_size(b)
    assert len(segments) >= 3, "the job should spread over several lanes"
    for (path, _, _), offset in zip(segments, (48, 51 + 26, 111), strict=False):
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            assert (byte != 0) == (offset < 52), (path.name, offset)  # a letter, or padding
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))
    again = restart_and_finish(tmp_path, b)
    counts, codes = delivered(again, tmp_path)
    assert codes == {}  # nothing became corrupt_input
    assert set(counts) == {f"r{i}" for i in stored} and set(counts.values()) == {1}
    assert len(again.broker_status()["damaged_segments"]) == 3
    assert again.stop() == exitcodes.OK, again.stderr
    check = cli(again.config, "check")
    assert check.returncode == 0, check.stdout
    assert_check_clean(again.data_dir)
    again.close()


def test_rotten_markers_and_a_rotten_last_slot_end_as_errors_and_check_says_so(
    tmp_path, queued_job
):
    b, stored = queued_job
    segments = segments_by_size(b)
    (path_a, live_a, index_a), (path_b, live_b, index_b) = segments[0], segments[1]
    with Segment.open(path_a, writable=True) as seg:
        seg.markers[live_a[3]] = DEAD  # bit rot: retired with no result
        seg.markers[live_a[5]] = EMPTY  # bit rot over a valid, acknowledged slot
        seg.sync()
    with Segment.open(path_b, writable=True) as seg:
        seg.bodies[live_b[-1], 40] ^= 0x04  # the last slot rots: looks like a torn write
        seg.sync()
    lost = {f"r{i}" for i in (index_a[3], index_a[5], index_b[-1])}

    found = cli(b.config, "check")
    assert found.returncode == exitcodes.FINDINGS, found.stdout
    assert "lost-items" in found.stdout and "3 acknowledged item(s)" in found.stdout
    assert "marker DEAD but no result" in found.stdout
    assert "marker EMPTY over a valid slot" in found.stdout
    assert "rotten-tail" in found.stdout and "torn-tail" not in found.stdout
    fixed = cli(b.config, "check", "--fix")
    assert fixed.returncode == exitcodes.FINDINGS, fixed.stdout  # repaired, with a loss: not clean
    assert "not clean: 3 acknowledged item(s) were lost" in fixed.stdout
    assert cli(b.config, "check").returncode == exitcodes.OK

    again = restart_and_finish(tmp_path, b)
    counts, codes = delivered(again, tmp_path)
    assert set(counts) == {f"r{i}" for i in stored} and set(counts.values()) == {1}
    assert codes == dict.fromkeys(lost, "corrupt_input")
    assert again.stop() == exitcodes.OK, again.stderr
    assert_check_clean(again.data_dir)
    again.close()


def test_a_rotten_last_slot_cut_at_start_ends_as_an_error_not_silently(tmp_path, queued_job):
    b, stored = queued_job
    path, live, index = segments_by_size(b)[0]
    with Segment.open(path, writable=True) as seg:
        seg.bodies[live[-1], 8] ^= 0x01  # recovery takes it for a torn tail and cuts it
        seg.sync()
    again = restart_and_finish(tmp_path, b)  # no check --fix first
    counts, codes = delivered(again, tmp_path)
    assert set(counts) == {f"r{i}" for i in stored} and set(counts.values()) == {1}
    assert codes == {f"r{index[-1]}": "corrupt_input"}
    assert again.stop() == exitcodes.OK, again.stderr
    assert_check_clean(again.data_dir)
    again.close()


def test_a_segment_damaged_while_serving_is_reported_and_dispatch_keeps_running(tmp_path):
    b = Broker(write_config(tmp_path, workers=0)).start()
    dispatch = b.pids()["dispatch-0"]
    junk = b.data_dir.segments / "in-000000000099.echo.s1.l128.seg"
    junk.write_bytes(np.random.default_rng(3).bytes(1 << 16))  # found by dispatch's rescan

    def reported() -> bool:
        return junk.name in b.broker_status()["damaged_segments"]

    wait_for(reported, "status to report the damaged file", timeout_s=30)
    assert b.proc.poll() is None and b.pids()["dispatch-0"] == dispatch  # never restarted
    assert b.stop() == exitcodes.OK, b.stderr
    fixed = cli(b.config, "check", "--fix")  # isolates it, as the next start would
    assert fixed.returncode == exitcodes.OK, fixed.stdout
    assert (b.data_dir.damaged / junk.name).exists()
    assert_check_clean(b.data_dir)
    b.close()
