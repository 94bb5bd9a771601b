"""Vector shards on real files: round trip, recovery from every kind of damage, SIGKILL."""

from __future__ import annotations

import importlib.util
import itertools
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zygote
from conftest import assert_check_clean, small_tmpfs

from collector.vectors.shard import Shard, shard_paths
from collector.vectors.store_catalog import create_store
from collector.vectors.vector_errors import VectorInputError, VectorSealedError, VectorShardError
from collector.vectors.vector_store import VectorStore
from pipeline.core.errors import DiskFullError
from pipeline.store.datadir import DataDir
from pipeline.store.records import read_records

PROCS = Path(__file__).parent / "procs"
_spec = importlib.util.spec_from_file_location("vector_writer", PROCS / "vector_writer.py")
vector_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vector_writer)
expected_rows = vector_writer.expected_rows

DIM = 16


def filled(tmp_path: Path, batches=(5, 7, 3), dtype="float32") -> Shard:
    shard = Shard.create(tmp_path, 0, DIM, dtype)
    for n in batches:
        shard.append(*expected_rows(shard.rows + shard.pending_rows, n, DIM))
        shard.flush()
    return shard


def assert_rows_ok(shard: Shard) -> None:
    """Every durable row holds its expected id and values; files hold nothing more."""
    ids, rows = shard.read(0, shard.rows)
    want_ids, want_rows = expected_rows(0, shard.rows, DIM)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(rows, want_rows.astype(shard.dtype))
    assert shard.payload_path.stat().st_size == shard.rows * shard.row_bytes
    assert shard.ids_path.stat().st_size == shard.rows * 8
    del ids, rows


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_and_reopen(tmp_path, dtype):
    shard = Shard.create(tmp_path, 3, DIM, dtype)
    ids, rows = expected_rows(0, 10, DIM)
    assert shard.append(ids[:4], rows[:4]) == (3, 0)
    assert shard.append(ids[4:], rows[4:]) == (3, 4)
    assert shard.rows == 0
    assert shard.flush() == (0, 10)
    assert shard.flush() == (10, 0)
    got_ids, got_rows = shard.read(2, 5)
    np.testing.assert_array_equal(got_ids, ids[2:7])
    np.testing.assert_array_equal(got_rows, rows[2:7].astype(dtype))
    del got_ids, got_rows
    shard.close()
    with Shard.open(tmp_path, 3) as again:
        assert (again.rows, again.dim, again.dtype) == (10, DIM, np.dtype(dtype))
        assert again.append(*expected_rows(10, 2, DIM)) == (3, 10)
        again.flush()
    with Shard.open(tmp_path, 3) as again:
        assert again.rows == 12
        assert_rows_ok(again)


def test_unflushed_rows_are_not_durable(tmp_path):
    shard = filled(tmp_path)
    shard.append(*expected_rows(15, 4, DIM))
    shard.close()
    with Shard.open(tmp_path, 0) as again:
        assert again.rows == 15


def test_seal_makes_the_shard_immutable(tmp_path):
    shard = filled(tmp_path)
    shard.append(*expected_rows(15, 1, DIM))
    shard.seal()
    assert shard.rows == 16
    with pytest.raises(VectorSealedError, match="sealed"):
        shard.append(*expected_rows(16, 1, DIM))
    shard.close()
    with Shard.open(tmp_path, 0) as again:
        assert again.sealed and again.rows == 16
        with pytest.raises(VectorSealedError):
            again.append(*expected_rows(16, 1, DIM))


def test_second_writer_is_refused(tmp_path):
    with filled(tmp_path), pytest.raises(VectorShardError, match="another process"):
        Shard.open(tmp_path, 0)


def test_torn_last_journal_record_at_every_offset(tmp_path):
    filled(tmp_path).close()
    journal = shard_paths(tmp_path, 0)[2]
    data = journal.read_bytes()
    records, _ = read_records(journal)
    last = _start_of_last(data)
    assert records[-1]["first"] == 12
    for cut in range(last, len(data)):
        journal.write_bytes(data[:cut])
        with Shard.open(tmp_path, 0) as shard:
            assert shard.rows == 12, cut
            assert_rows_ok(shard)
        assert journal.stat().st_size == last
        # the cut-back payload must be rewritten for the next offset
        journal.write_bytes(data)
        filled_again(tmp_path)


def _start_of_last(data: bytes) -> int:
    pos, start = 0, 0
    while pos < len(data):
        start = pos
        pos += 8 + int.from_bytes(data[pos : pos + 4], "little")
    return start


def filled_again(tmp_path: Path) -> None:
    """Restore payload and ids to the 15 rows of `filled`."""
    payload, ids, _ = shard_paths(tmp_path, 0)
    want_ids, want_rows = expected_rows(0, 15, DIM)
    payload.write_bytes(want_rows.tobytes())
    ids.write_bytes(want_ids.tobytes())


def test_corrupt_byte_in_last_record_is_cut(tmp_path):
    filled(tmp_path).close()
    journal = shard_paths(tmp_path, 0)[2]
    data = journal.read_bytes()
    last = _start_of_last(data)
    for pos in range(last + 8, len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x20
        journal.write_bytes(bytes(bad))
        with Shard.open(tmp_path, 0) as shard:
            assert shard.rows == 12
        journal.write_bytes(data)
        filled_again(tmp_path)


def test_damage_before_the_last_record_is_an_error(tmp_path):
    filled(tmp_path).close()
    journal = shard_paths(tmp_path, 0)[2]
    data = bytearray(journal.read_bytes())
    second = 8 + int.from_bytes(data[0:4], "little")
    data[second + 10] ^= 0x20
    journal.write_bytes(bytes(data))
    with pytest.raises(VectorShardError, match="not a torn tail"):
        Shard.open(tmp_path, 0)


def test_partial_rows_beyond_the_journal_are_cut(tmp_path):
    filled(tmp_path).close()
    payload, ids, _ = shard_paths(tmp_path, 0)
    with payload.open("ab") as f:
        f.write(b"\x01" * (DIM * 4 * 2 + 3))
    with ids.open("ab") as f:
        f.write(b"\x02" * 11)
    with Shard.open(tmp_path, 0) as shard:
        assert shard.rows == 15
        assert_rows_ok(shard)


@pytest.mark.parametrize("which", ["payload", "ids"])
def test_truncated_data_is_refused(tmp_path, which):
    filled(tmp_path).close()
    path = shard_paths(tmp_path, 0)[0 if which == "payload" else 1]
    size = path.stat().st_size
    os.truncate(path, size - 5)
    with pytest.raises(VectorShardError, match=r"acknowledged data was lost") as err:
        Shard.open(tmp_path, 0)
    assert str(path) in str(err.value) and "15 rows" in str(err.value)


def test_journal_longer_than_the_data_is_refused(tmp_path):
    filled(tmp_path).close()
    payload, ids, _ = shard_paths(tmp_path, 0)
    os.truncate(payload, 12 * DIM * 4)
    os.truncate(ids, 12 * 8)
    with pytest.raises(VectorShardError, match=r"12 whole rows.*acknowledges 15 rows"):
        Shard.open(tmp_path, 0)


def test_rewritten_last_rows_fail_the_checksum(tmp_path):
    filled(tmp_path).close()
    payload = shard_paths(tmp_path, 0)[0]
    with payload.open("r+b") as f:
        f.seek(14 * DIM * 4)
        f.write(b"\x00" * 4)
    with pytest.raises(VectorShardError, match="fail the journal checksum"):
        Shard.open(tmp_path, 0)


def test_bad_input_is_refused_and_nothing_appended(tmp_path):
    shard = filled(tmp_path)
    ids, rows = expected_rows(15, 4, DIM)
    with pytest.raises(VectorInputError, match=rf"shape \(4, 15\).*\(n, {DIM}\)"):
        shard.append(ids, rows[:, :15])
    bad = rows.copy()
    bad[2, 5] = np.nan
    with pytest.raises(VectorInputError, match=rf"row 2 of the batch \(id {ids[2]}\)"):
        shard.append(ids, bad)
    bad[2, 5] = np.inf
    with pytest.raises(VectorInputError, match="row 2"):
        shard.append(ids, bad)
    with pytest.raises(VectorInputError, match="need 4 integers"):
        shard.append(ids[:3], rows)
    with pytest.raises(VectorInputError, match="cannot be stored"):
        shard.append(ids, rows.astype(np.complex64))
    with pytest.raises(VectorInputError, match="negative"):
        shard.append(np.array([1, -2, 3, 4]), rows)
    assert shard.pending_rows == 0
    assert shard.flush() == (15, 0)
    assert_rows_ok(shard)
    shard.close()


def test_float16_overflow_is_refused(tmp_path):
    with Shard.create(tmp_path, 0, 2, "float16") as shard:
        with pytest.raises(VectorInputError, match="row 1"):
            shard.append(np.array([1, 2]), np.array([[1.0, 2.0], [1e6, 0.0]]))
        assert shard.pending_rows == 0


def test_create_refuses_existing_and_bad_settings(tmp_path):
    filled(tmp_path).close()
    with pytest.raises(VectorShardError, match="already exists"):
        Shard.create(tmp_path, 0, DIM, "float32")
    with pytest.raises(VectorInputError, match="dtype 'float64'"):
        Shard.create(tmp_path, 1, DIM, "float64")
    with pytest.raises(VectorShardError, match="no such shard"):
        Shard.open(tmp_path, 9)


def test_disk_full_is_retryable_and_loses_nothing_acknowledged(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as mount_point:
        filler = mount_point / "filler"
        filler.write_bytes(b"\0" * 200_000)
        shard = Shard.create(mount_point, 0, DIM, "float32")
        with pytest.raises(DiskFullError) as err:
            for _ in range(100):
                shard.append(*expected_rows(shard.rows, 1000, DIM))
                shard.flush()
        assert err.value.retryable and "disk full" in str(err.value)
        acked = shard.rows
        assert acked > 0 and shard.pending_rows == 1000
        filler.unlink()
        assert shard.flush() == (acked, 1000)  # the same rows, retried once space is free
        acked += 1000
        shard.close()
        with Shard.open(mount_point, 0) as again:
            assert again.rows == acked
            assert_rows_ok(again)


def test_store_rotates_and_reopens(tmp_path):
    store = VectorStore(tmp_path, DIM, "float32", shard_rows=10)
    ids, rows = expected_rows(0, 25, DIM)
    placed = store.append(ids[:7], rows[:7])
    assert placed.tolist() == [[0, 0, 7]]
    placed = store.append(ids[7:], rows[7:])
    assert placed.tolist() == [[0, 7, 3], [1, 0, 10], [2, 0, 5]]
    assert store.flush() == [(0, 0, 10), (1, 0, 10), (2, 0, 5)]
    store.append(*expected_rows(25, 2, DIM))
    store.close()  # the last two rows were never flushed
    with VectorStore(tmp_path, DIM, "float32", shard_rows=10) as again:
        assert again.rows == 25
        assert [s.sealed for s in again.shards] == [True, True, False]
        got_ids, got_rows = again.read(1, 0, 10)
        np.testing.assert_array_equal(got_ids, ids[10:20])
        np.testing.assert_array_equal(got_rows, rows[10:20])
        del got_ids, got_rows
        assert again.append(*expected_rows(25, 6, DIM)).tolist() == [[2, 5, 5], [3, 0, 1]]
        with pytest.raises(VectorInputError, match="NaN"):
            again.append(np.array([1]), np.full((1, DIM), np.nan))
        assert again.flush() == [(2, 5, 5), (3, 0, 1)]


def test_store_refuses_other_dim_and_missing_shard(tmp_path):
    with VectorStore(tmp_path, DIM, "float32", shard_rows=4) as store:
        store.append(*expected_rows(0, 9, DIM))
        store.flush()
    with pytest.raises(VectorShardError, match=f"dim {DIM}.*dim 8"):
        VectorStore(tmp_path, 8, "float32", shard_rows=4)
    shard_paths(tmp_path, 1)[2].unlink()
    with pytest.raises(VectorShardError, match="a shard is missing"):
        VectorStore(tmp_path, DIM, "float32", shard_rows=4)


class Writer:
    """The writer child; its `ack FIRST COUNT` lines land in a queue."""

    def __init__(self, directory: Path, seed: int) -> None:
        self.proc = zygote.Popen(
            [sys.executable, str(PROCS / "vector_writer.py"), str(directory), str(seed)],
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.acks: queue.Queue[tuple[int, int]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("ack ") and line.endswith("\n"):
                _, first, count = line.split()
                self.acks.put((int(first), int(count)))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        self.proc.stdout.close()


def test_sigkill_loses_nothing_acknowledged(tmp_path):
    create_store(tmp_path / "vectors", "s", "m", DIM, "float32", 1 << 30)[1].close()
    directory = tmp_path / "vectors" / "s"  # a store, so the project's check covers it
    Shard.create(directory, 0, DIM, "float32").close()
    chooser = random.Random(7)
    acked: list[tuple[int, int]] = []
    for cycle in range(15):
        writer = Writer(directory, cycle)
        for _ in range(chooser.randint(1, 40)):
            acked.append(writer.acks.get(timeout=30))
        writer.kill()
        while not writer.acks.empty():
            acked.append(writer.acks.get_nowait())
        with Shard.open(directory, 0) as shard:
            end = max(first + count for first, count in acked)
            assert shard.rows >= end
            assert_rows_ok(shard)
            ids, _ = shard.read(0, shard.rows)
            assert len(np.unique(ids)) == shard.rows  # each row exactly once
            del ids
    spans = sorted(a for a in acked if a[1])
    for (first, count), (later, _) in itertools.pairwise(spans):
        assert first + count <= later, "two acknowledgements name the same rows"
    assert len(spans) >= 8
    assert_check_clean(DataDir(tmp_path))
