"""Dispatch files (invariant 11): real files, a real full disk and real SIGKILLs."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zygote
from conftest import small_tmpfs, wait_for

from gpu.dispatch.file import DispatchFile
from gpu.dispatch.file_format import (
    HEADER_BYTES,
    LEASE_DTYPE,
    DispatchFileError,
    Lease,
    check_dispatch_file,
    parse_header,
)
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core.errors import FabricError

PROCS = Path(__file__).parent / "procs"
EPOCH = 1_764_000_000_123
CYCLES = 20


def items(segment: int, slots) -> np.ndarray:
    out = np.zeros(len(slots), LEASE_DTYPE)
    out["segment"] = segment
    out["slot"] = slots
    out["seq"] = segment * 1000 + out["slot"]
    return out


def summary(leases: list[Lease]) -> dict[int, tuple[str, list[tuple[int, int, int]]]]:
    return {lease.batch_id: (lease.session, lease.items.tolist()) for lease in leases}


def reload(path: Path, epoch: int = EPOCH) -> list[Lease]:
    file, leases = DispatchFile.open(path, epoch)
    file.close()
    return leases


def entry_offsets(data: bytes) -> list[int]:
    offsets, pos = [], HEADER_BYTES
    while pos < len(data):
        offsets.append(pos)
        pos += 8 + int.from_bytes(data[pos : pos + 4], "little")
    return offsets


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "dispatch.ifd"


def test_item_dtype_is_the_dispatch_state_one():
    assert LEASE_DTYPE == ITEM_DTYPE and LEASE_DTYPE.itemsize == 20


def test_round_trip_of_leases_drops_and_ends(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "session-a", items(10, range(5)))
        file.lease(2, "session-b", items(11, range(3)))
        file.lease(3, "session-a", items(12, range(4)))
        file.drop(1, np.array([0, 3], np.uint32))
        file.drop(2)  # END
        file.drop(3, np.array([], np.uint32))  # records nothing
        assert file.sync()
    file.close()  # again: nothing happens
    assert not file.sync()
    assert summary(reload(path)) == {
        1: ("session-a", items(10, [1, 2, 4]).tolist()),
        3: ("session-a", items(12, range(4)).tolist()),
    }
    assert check_dispatch_file(path, EPOCH) == []


def test_a_slot_leased_under_two_batches_belongs_to_the_later_one(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(7, "old", items(5, [0, 1, 2]))
        file.lease(8, "new", items(5, [1]))  # slot 1 handed out again without a DROP of 7
        file.lease(9, "other", items(6, [1]))  # same slot, another segment: no conflict
    assert summary(reload(path)) == {
        7: ("old", items(5, [0, 2]).tolist()),
        8: ("new", items(5, [1]).tolist()),
        9: ("other", items(6, [1]).tolist()),
    }
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.drop(8)  # the later batch ends: slot 1 is free, not back with batch 7
    assert summary(reload(path)) == {
        7: ("old", items(5, [0, 2]).tolist()),
        9: ("other", items(6, [1]).tolist()),
    }


def test_a_drop_before_a_new_lease_of_the_same_slot_does_not_undo_it(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(3, [4, 5]))
        file.drop(1, np.array([4]))
        file.lease(2, "b", items(3, [4]))
    assert summary(reload(path)) == {
        1: ("a", items(3, [5]).tolist()),
        2: ("b", items(3, [4]).tolist()),
    }


def test_nothing_is_reloaded_when_every_lease_was_resolved(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(1, [0, 1]))
        file.lease(2, "b", items(2, [0]))
        file.drop(1, np.array([0, 1]))
        file.drop(2)
    assert reload(path) == []
    assert check_dispatch_file(path, EPOCH) == []


def test_another_epoch_discards_the_file(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(1, range(10)))
    file, leases = DispatchFile.open(path, EPOCH + 1)
    with file:
        assert leases == []
        assert path.stat().st_size == HEADER_BYTES
        assert parse_header(path.read_bytes())[0] == EPOCH + 1
        file.lease(2, "b", items(2, [0]))
    assert reload(path, EPOCH) == []  # the old life's entries are gone for good
    assert not path.with_name(path.name + ".tmp").exists()


@pytest.mark.parametrize("offset", [0, 7, 8, 12, 16, 23, 24, 32, 35])
def test_a_damaged_header_starts_a_fresh_file(path, offset):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(1, range(10)))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    assert reload(path) == []
    assert path.stat().st_size == HEADER_BYTES and check_dispatch_file(path, EPOCH) == []


@pytest.mark.parametrize("size", [0, 1, HEADER_BYTES - 1])
def test_a_short_file_starts_a_fresh_file(path, size):
    path.write_bytes(bytes(size))
    assert reload(path) == []
    assert parse_header(path.read_bytes())[0] == EPOCH


def test_a_torn_tail_at_every_byte_reloads_the_earlier_entries_and_appends_after_them(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(1, range(4)))
        file.lease(2, "b", items(2, range(3)))
        assert file.sync()
        before = path.stat().st_size
        file.drop(1, np.array([2]))
        file.lease(3, "session-c", items(3, range(3)))
    whole = path.read_bytes()
    earlier = {1: ("a", items(1, range(4)).tolist()), 2: ("b", items(2, range(3)).tolist())}
    last_start = entry_offsets(whole)[-1]
    assert entry_offsets(whole)[-2] == before
    for cut in range(before, len(whole)):
        path.write_bytes(whole[:cut])
        file, leases = DispatchFile.open(path, EPOCH)
        with file:
            expected = dict(earlier)
            if cut >= last_start:  # the drop is whole; only the last lease is torn
                expected[1] = ("a", items(1, [0, 1, 3]).tolist())
            assert summary(leases) == expected, cut
            assert path.stat().st_size == (last_start if cut >= last_start else before)
            file.lease(9, "z", items(9, [0]))
        expected[9] = ("z", items(9, [0]).tolist())
        assert summary(reload(path)) == expected, cut
        assert check_dispatch_file(path, EPOCH) == []


@pytest.mark.parametrize("where", [0, 3, 4, 8, 9, 17, 21, 22, -1])
def test_a_flipped_bit_in_an_entry_stops_the_reading_there(path, where):
    with DispatchFile.open(path, EPOCH)[0] as file:
        file.lease(1, "a", items(1, range(3)))
        file.lease(2, "b", items(2, range(3)))
        file.drop(1)
    data = bytearray(path.read_bytes())
    offsets = entry_offsets(bytes(data))
    assert len(offsets) == 3
    second = offsets[1]
    at = second + where if where >= 0 else offsets[2] + where
    data[at] ^= 0x04
    path.write_bytes(bytes(data))
    file, leases = DispatchFile.open(path, EPOCH)
    with file:
        assert summary(leases) == {1: ("a", items(1, range(3)).tolist())}
        assert path.stat().st_size == second  # the damaged entry and all after it are cut
        file.lease(4, "d", items(4, [1]))
    assert summary(reload(path)) == {
        1: ("a", items(1, range(3)).tolist()),
        4: ("d", items(4, [1]).tolist()),
    }


def test_compaction_keeps_exactly_the_live_leases_and_shrinks_the_file(path, rng):
    live: dict[int, Lease] = {}
    with DispatchFile.open(path, EPOCH)[0] as file:
        for batch_id in range(1, 301):
            live[batch_id] = Lease(batch_id, f"s{batch_id % 4}", items(batch_id, range(50)))
            file.lease(batch_id, live[batch_id].session, live[batch_id].items)
            if batch_id % 4:
                file.drop(batch_id)
                del live[batch_id]
            elif batch_id % 8 == 0:
                gone = rng.random(50) < 0.5
                file.drop(batch_id, live[batch_id].items["slot"][gone])
                live[batch_id].items = live[batch_id].items[~gone]
        assert file.sync()
        big = path.stat().st_size
        assert file.file_bytes == big and file.garbage_ratio > 0.7
        file.lease(999, "not-in-live", items(999, [0]))  # superseded by the compaction
        file.compact(list(live.values()))
        assert file.sync()
        assert file.garbage_ratio == 0.0
        assert path.stat().st_size == file.file_bytes < big / 3
        assert summary(reload_copy(path)) == summary(list(live.values()))
        file.lease(1000, "after", items(1000, [3]))
    assert not path.with_name(path.name + ".tmp").exists()
    live[1000] = Lease(1000, "after", items(1000, [3]))
    assert summary(reload(path)) == summary(list(live.values()))
    assert check_dispatch_file(path, EPOCH) == []


def reload_copy(path: Path, into: Path | None = None) -> list[Lease]:
    """The leases of `path` as a restart would see them, without touching the open file."""
    copy = (into or path.parent) / "copy.ifd"
    copy.write_bytes(path.read_bytes())
    return reload(copy)


def test_maybe_sync_after_32_entries_or_100_ms_on_the_owner_clock(path):
    file, _ = DispatchFile.open(path, EPOCH)
    with file:
        assert not file.maybe_sync(5.0)  # nothing pending
        for batch_id in range(31):
            file.lease(batch_id, "w", items(batch_id, [0]))
        assert not file.maybe_sync(5.0)
        assert not file.maybe_sync(5.05)
        file.lease(31, "w", items(31, [0]))
        assert file.maybe_sync(5.05)  # the 32nd entry
        assert file.pending_entries == 0
        wait_for(lambda: path.stat().st_size == file.file_bytes, "the writer thread to write")
        assert len(reload_copy(path)) == 32

        file.drop(3)
        assert not file.maybe_sync(1.0)  # the clock starts when an entry is first seen
        assert not file.maybe_sync(1.0999)
        assert file.maybe_sync(1.0 + 0.1)
        assert not file.maybe_sync(1.2)
        wait_for(lambda: path.stat().st_size == file.file_bytes, "the writer thread to write")
        assert 3 not in summary(reload_copy(path))


def test_bad_input_is_refused_naming_the_value(path):
    with DispatchFile.open(path, EPOCH)[0] as file:
        with pytest.raises(FabricError, match="'" + "w" * 65 + "' has 65 characters"):
            file.lease(1, "w" * 65, items(1, [0]))
        with pytest.raises(DispatchFileError, match="not ASCII"):
            file.lease(1, "wörker", items(1, [0]))
        with pytest.raises(DispatchFileError, match="LEASE_DTYPE"):
            file.lease(1, "w", np.zeros(3, np.uint64))
        with pytest.raises(DispatchFileError, match="one segment"):
            file.lease(1, "w", np.concatenate([items(1, [0]), items(2, [0])]))
        with pytest.raises(DispatchFileError, match="batch id -1"):
            file.lease(-1, "w", items(1, [0]))
        with pytest.raises(DispatchFileError, match="1-D integer"):
            file.drop(1, np.array([0.5]))
        file.lease(1, "w" * 64, items(1, [0]))
        assert file.pending_entries == 1
    assert summary(reload(path)) == {1: ("w" * 64, items(1, [0]).tolist())}


def fill(directory: Path) -> Path:
    """Fill the file system under `directory` to the last byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(size))
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_logged_and_retried_never_raised(tmp_path, caplog):
    with small_tmpfs(tmp_path / "small", "1m") as mount_point:
        path = mount_point / "dispatch.ifd"
        file, _ = DispatchFile.open(path, EPOCH)
        with file:
            file.lease(1, "a", items(1, range(100)))
            assert file.sync()
            filler = fill(mount_point)
            file.lease(2, "b", items(2, range(2000)))
            assert not file.sync()  # 40 KB do not fit: logged, kept
            assert file.failing
            assert any(
                r.levelname == "ERROR" and str(path) in r.getMessage() for r in caplog.records
            )
            assert check_dispatch_file(path, EPOCH) == []  # the partial write was cut
            file.drop(1, np.array([0]))
            assert not file.maybe_sync(0.0)  # a failed write waits sync_ms for its retry
            assert file.maybe_sync(0.1)
            assert not file.sync() and summary(reload_copy(path, tmp_path)).keys() == {1}

            live = [Lease(1, "a", items(1, range(1, 100))), Lease(2, "b", items(2, range(2000)))]
            file.compact(live)  # fails too while the disk is full; supersedes the backlog
            assert not file.sync()
            filler.unlink()
            assert file.sync() and not file.failing
            assert summary(reload_copy(path, tmp_path)) == summary(live)
            file.lease(3, "c", items(3, [0]))
        assert summary(reload(path)) == {**summary(live), 3: ("c", items(3, [0]).tolist())}
        assert check_dispatch_file(path, EPOCH) == []


class Child:
    """A child process whose complete stdout lines land in a queue (read by a thread)."""

    def __init__(self, *args: str) -> None:
        self.proc = zygote.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.endswith("\n"):  # a line cut by SIGKILL was never complete
                self.lines.put(line)

    def kill(self) -> list[str]:
        """SIGKILL it; return every complete line it printed that is still queued."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        self.proc.stdout.close()
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get())
        return rest


def bounds(expected: dict[int, set[int]], lines: list[str]):
    """The slots each batch must hold (lower) and may hold (upper) after the child's lines.

    Operations before the last `synced` line are durable; those after it may be.
    """
    last_sync = max((i for i, line in enumerate(lines) if line == "synced\n"), default=-1)
    lower = {b: set(slots) for b, slots in expected.items()}
    upper = {b: set(slots) for b, slots in expected.items()}
    for i, line in enumerate(lines):
        durable = i < last_sync
        what, *args = line.split()
        if what == "lease":
            upper[int(args[0])] = set(range(int(args[1])))
            if durable:
                lower[int(args[0])] = set(range(int(args[1])))
        elif what == "drop":
            slots = set(map(int, args[1:]))
            lower.get(int(args[0]), set()).difference_update(slots)
            if durable:
                upper.get(int(args[0]), set()).difference_update(slots)
        elif what == "end":
            lower.pop(int(args[0]), None)
            if durable:
                upper.pop(int(args[0]), None)
    return lower, upper


def test_sigkill_at_random_moments_never_loses_a_synced_lease(path):
    rnd = random.Random(int(os.environ.get("FABRIC_CRASH_SEED", "20261201")))
    expected: dict[int, set[int]] = {}  # the file's state after the last check
    sessions: dict[int, str] = {}
    counts = {"lease": 0, "drop": 0, "end": 0, "compact": 0, "synced": 0}
    for cycle in range(CYCLES):
        first = (cycle + 1) * 100_000
        child = Child(
            str(PROCS / "dispatch_file_writer.py"), str(path), str(EPOCH), str(first), str(cycle)
        )
        target, lines = rnd.randint(2, 30), []
        deadline = time.monotonic() + 30
        while lines.count("synced\n") < target:
            assert time.monotonic() < deadline and child.proc.poll() is None, "writer stalled"
            with contextlib.suppress(queue.Empty):
                lines.append(child.lines.get(timeout=1))
        lines += child.kill()
        for line in lines:
            counts[line.split()[0]] += 1
            if line.startswith("lease"):
                sessions[int(line.split()[1])] = line.split()[3]

        lower, upper = bounds(expected, lines)
        got = {lease.batch_id: lease for lease in reload(path)}
        for batch_id, lease in got.items():
            assert batch_id in upper, f"batch {batch_id} reloaded, but ended (cycle {cycle})"
            assert lease.session == sessions[batch_id]
            assert np.array_equal(lease.items, items(batch_id, lease.items["slot"]))
            slots = set(lease.items["slot"].tolist())
            assert slots <= upper[batch_id], f"batch {batch_id}: dropped slots came back"
        for batch_id, slots in lower.items():
            held = set(got[batch_id].items["slot"].tolist()) if batch_id in got else set()
            assert slots <= held, f"batch {batch_id}: synced slots lost (cycle {cycle})"
        assert check_dispatch_file(path, EPOCH) == []
        expected = {b: set(lease.items["slot"].tolist()) for b, lease in got.items()}
    assert all(counts.values()), counts
    print(f"{CYCLES} kill cycles: {counts}")


def test_open_refuses_bad_settings(path):
    with pytest.raises(DispatchFileError, match="sync_entries 0"):
        DispatchFile.open(path, EPOCH, sync_entries=0)
    with pytest.raises(DispatchFileError, match="epoch -1"):
        DispatchFile.open(path, -1)
