"""The reuse index (pipeline/store/reuse_store.py, reuse_table.py) on real files: found again,
evicted by retention and size cap, kept through a SIGKILLed writer, its damage found by check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from assembly.check import check_data_dir
from pipeline.core.ragged import Ragged, offsets_of
from pipeline.store.datadir import DataDir
from pipeline.store.reuse_store import (
    GRACE_S,
    ReuseReader,
    ReuseWriter,
    data_files,
    read_results,
    reuse_dir,
)
from pipeline.store.reuse_table import HEADER_BYTES, SLOT, TABLE_FILE
from tests.conftest import wait_for


def keys_of(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, size=(n, 2), dtype=np.uint64)


def payloads(n: int, size: int = 40) -> Ragged:
    values = np.arange(n * size, dtype=np.uint8) ^ 0x5A
    return Ragged(values, offsets_of(np.full(n, size, np.int64)))


def write(writer: ReuseWriter, keys: np.ndarray, now_ns: int | None = None) -> None:
    n = len(keys)
    writer.append(
        keys,
        np.full(n, 2, np.uint8),
        np.zeros(n, np.uint8),
        np.arange(n, dtype=np.uint32) + 7,
        payloads(n),
        now_ns,
    )
    writer.flush()


def test_results_are_found_again_by_key_and_only_by_key(tmp_path):
    writer = ReuseWriter(tmp_path, retention_s=3600, max_bytes=1 << 30)
    keys = keys_of(20_000)  # past the first table's room: it grows while indexing
    write(writer, keys[:10_000])
    write(writer, keys[10_000:])
    write(writer, keys[:5])  # indexed again: left as it is
    assert writer.entries == 20_000
    reader = ReuseReader(tmp_path)
    where = reader.lookup(np.concatenate([keys[:100], keys_of(100, seed=2)]))
    assert (where[:100, 0] > 0).all() and (where[100:, 0] == 0).all()
    results = read_results(tmp_path, keys[:100], where[:100])
    assert [r.prompt_tokens for r in results] == list(range(7, 107))  # type: ignore[union-attr]
    assert results[3].payload == payloads(100).take(np.array([3])).values.tobytes()  # type: ignore[union-attr]
    # a record read back under another key is refused, never a wrong result
    assert read_results(tmp_path, keys[1:2], where[:1]) == [None]
    writer.close()
    assert check_data_dir(DataDir(tmp_path)).clean


def test_retention_and_the_size_cap_evict_oldest_data_files_first(tmp_path):
    writer = ReuseWriter(tmp_path, retention_s=100.0, max_bytes=1 << 30)
    old, mid, new = keys_of(50, 1), keys_of(50, 2), keys_of(50, 3)
    for keys in (old, mid, new):
        write(writer, keys)
        writer.close()  # each writer life writes its own data file
        writer = ReuseWriter(tmp_path, retention_s=100.0, max_bytes=1 << 30)
    files = [p for _, _, p in data_files(reuse_dir(tmp_path))]
    now = os.stat(files[-1]).st_mtime
    os.utime(files[0], (now - 500, now - 500))  # past retention
    assert writer.evict(now) == [1]
    reader = ReuseReader(tmp_path)
    assert (reader.lookup(old)[:, 0] == 0).all()
    assert (reader.lookup(mid)[:, 0] > 0).all()
    # the size cap: the oldest files go until the rest fit
    writer.max_bytes = os.stat(files[2]).st_size
    assert writer.evict(now) == [2]
    assert (reader.lookup(mid)[:, 0] == 0).all() and (reader.lookup(new)[:, 0] > 0).all()
    # an evicted file stays readable for a line found just before, then goes
    assert [e for _, e, _ in data_files(reuse_dir(tmp_path))] == [True, True, False]
    writer.retention_s = 2 * GRACE_S  # the newest file is kept
    writer.evict(now + GRACE_S + 1)
    assert [e for _, e, _ in data_files(reuse_dir(tmp_path))] == [False]
    writer.close()
    assert check_data_dir(DataDir(tmp_path)).clean


def test_check_finds_a_damaged_entry_and_fix_drops_it(tmp_path):
    writer = ReuseWriter(tmp_path, retention_s=3600, max_bytes=1 << 30)
    keys = keys_of(30)
    write(writer, keys)
    writer.close()
    where = ReuseReader(tmp_path).lookup(keys[:2])
    data = reuse_dir(tmp_path) / f"data-{int(where[0, 0]):08d}.log"
    with open(data, "r+b") as f:  # one record's payload rots on disk
        f.seek(int(where[0, 1]) + 60)
        f.write(b"\xff\xff")
    table = reuse_dir(tmp_path) / TABLE_FILE
    slots = np.fromfile(table, SLOT, offset=HEADER_BYTES)
    used = np.flatnonzero(slots["file"])
    with open(table, "r+b") as f:  # and another entry's slot is torn
        f.seek(HEADER_BYTES + int(used[-1]) * SLOT.itemsize + 20)
        f.write(b"\x01")
    report = check_data_dir(DataDir(tmp_path))
    assert [f.code for f in report.findings] == ["reuse-entry-damaged"]
    assert "2 of 30 entries" in report.findings[0].message
    # never reused meanwhile: the rotten record reads as gone
    assert read_results(tmp_path, keys[:1], where[:1]) == [None]
    fixed = check_data_dir(DataDir(tmp_path), fix=True)
    assert fixed.fixed and fixed.remaining == []
    assert check_data_dir(DataDir(tmp_path)).clean


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from pipeline.core.ragged import Ragged, offsets_of
    from pipeline.store.reuse_store import ReuseWriter
    writer = ReuseWriter(sys.argv[1], retention_s=3600, max_bytes=1 << 30)
    rng = np.random.default_rng(7)
    batch = 0
    while True:
        keys = rng.integers(1, 2**63, size=(500, 2), dtype=np.uint64)
        writer.append(keys, np.full(500, 2, np.uint8), np.zeros(500, np.uint8),
                      np.ones(500, np.uint32), Ragged(np.zeros(500 * 64, np.uint8),
                      offsets_of(np.full(500, 64, np.int64))))
        writer.flush()
        batch += 1
        if batch == 4:
            print("ready", flush=True)
    """
)


def test_a_writer_sigkilled_while_indexing_leaves_every_entry_readable(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        wait_for(lambda: sum(1 for _ in data_files(reuse_dir(tmp_path))), "a data file")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert check_data_dir(DataDir(tmp_path)).clean  # every indexed entry reads back whole
    writer = ReuseWriter(tmp_path, retention_s=3600, max_bytes=1 << 30)  # the next life
    assert writer.entries >= 2000
    more = keys_of(10, seed=9)
    write(writer, more)
    writer.close()
    assert (ReuseReader(tmp_path).lookup(more)[:, 0] > 0).all()
    assert check_data_dir(DataDir(tmp_path)).clean


def test_results_that_come_before_their_chunk_is_committed_are_indexed_once_it_is(tmp_path):
    """Dispatch hands items out once their writer synced them, before the front's commit
    record names their keys: completion holds such results and indexes them later."""
    import logging

    from collector.completion.record_format import flags_of
    from collector.completion.reuse import ResultReuse
    from collector.job_view import JobView
    from ingest.jobs import JobRegistry
    from ingest.reuse_keys import key_hex
    from pipeline.core.result_kinds import ResultKind, ResultStatus
    from pipeline.store.job_files import JobFiles

    registry = JobRegistry(tmp_path)
    job = registry.create("j1", chunk_lines=10, reuse=True)
    job.accept(0, 1, 3)
    registry.touch(job)
    registry.flush()
    view = JobView(JobFiles(tmp_path), "j1")
    reuse = ResultReuse(tmp_path, None, 3600.0, 1 << 30, logging.getLogger("test"))  # type: ignore[arg-type]
    flags = np.full(3, flags_of(ResultStatus.RESULT, ResultKind.VECTOR), np.uint32)
    reuse.note(view, np.arange(3), flags, payloads(3), np.ones(3, np.uint32))
    keys = keys_of(3, seed=5)
    job.commit(
        0,
        [1, 2, 3],
        ["a", "b", "c"],
        3,
        [],
        True,
        reuse={"rk": {"lines": [1, 2, 3], "keys": "".join(key_hex(keys))}},
    )
    registry.touch(job)
    registry.flush()
    reuse.flush(0.0, force=True)
    assert (ReuseReader(tmp_path).lookup(keys)[:, 0] > 0).all()
    reuse.close()
    registry.close()


def test_a_writer_starts_a_new_data_file_each_eighth_of_the_retention(tmp_path):
    """Retention drops whole files: a file that took appends all along would never go."""
    writer = ReuseWriter(tmp_path, retention_s=800.0, max_bytes=1 << 30)
    t0 = 1_800_000_000 * 10**9
    write(writer, keys_of(10, 1), now_ns=t0)
    write(writer, keys_of(10, 2), now_ns=t0 + 50 * 10**9)  # same file
    write(writer, keys_of(10, 3), now_ns=t0 + 101 * 10**9)  # past 800 / 8 s: a new one
    writer.close()
    assert len(data_files(reuse_dir(tmp_path))) == 2
