"""The shared-memory ring: real producer and consumer processes, backpressure, refusals, names.

Run as a script for the throughput benchmark:

    .venv/bin/python tests/test_ring.py [RECORD_KIB] [TOTAL_MIB]
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.errors import RingError
from pipeline.transport.ring import HEADER_BYTES, RECORD_HEADER_BYTES, Ring
from pipeline.transport.ring_layout import record_arrays
from pipeline.transport.ring_names import NAME_MAX_CHARS, ring_name
from pipeline.transport.ring_port import RingPort

END_KIND = 1000
STALL_S = 60.0  # a child that makes no progress this long reports failure and exits


@pytest.fixture
def name(tmp_path):
    """A ring name unique to this test (its tmp_path), unlinked afterwards."""
    ring = ring_name(tmp_path, "test", "ring", 0)
    yield ring
    Ring.unlink(ring)


def drain(ring: Ring) -> list[tuple[int, bytes]]:
    records = []
    while (record := ring.get()) is not None:
        records.append((record[0], bytes(record[1])))
    ring.release()
    return records


# ---- real processes ------------------------------------------------------------------------


def plan(seed: int, count: int, max_payload: int):
    """What the producer sends: record i is body pool[offsets[i]:][:sizes[i]], kind i % 7."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    sizes = rng.integers(0, 1500, count)
    big = rng.random(count) < 0.01
    sizes[big] = rng.integers(1500, max_payload + 1, int(big.sum()))
    sizes[count // 2] = max_payload  # exactly the largest record allowed
    offsets = rng.integers(0, pool.size - sizes.max(), count)
    return pool, sizes, offsets


def produce(ring_name_: str, seed: int, count: int, report) -> None:
    with Ring.attach(ring_name_) as ring:
        pool, sizes, offsets = plan(seed, count, ring.max_record_bytes - 16)
        full = 0
        for i in range(count):
            body = pool[offsets[i] : offsets[i] + sizes[i]]
            header = np.array([i, zlib.crc32(body)], dtype=np.uint64)
            stalled_at = None
            while ring.put(i % 7, header, body) is None:
                full += 1
                if full == 1:
                    report.put(("full", i))
                now = time.monotonic()
                stalled_at = stalled_at or now
                if now - stalled_at > STALL_S:
                    report.put(("producer", "stalled", i))
                    return
                os.sched_yield()
        while ring.put(END_KIND) is None:
            os.sched_yield()
    report.put(("producer", "done", full))


def consume(ring_name_: str, seed: int, count: int, report) -> None:
    errors: list[str] = []
    expected = 0
    with Ring.attach(ring_name_) as ring:
        pool, sizes, offsets = plan(seed, count, ring.max_record_bytes - 16)
        stalled_at = None
        while True:
            record = ring.get()
            if record is None:
                ring.release()  # release before waiting, or a full ring stalls both sides
                now = time.monotonic()
                stalled_at = stalled_at or now
                if now - stalled_at > STALL_S:
                    errors.append(f"stalled after {expected} records")
                    break
                os.sched_yield()
                continue
            stalled_at = None
            kind, payload = record
            if kind == END_KIND:
                break
            if expected >= count:
                errors.append(f"record past the end: kind {kind}")
                break
            size = int(sizes[expected])
            header, body = record_arrays(payload, (np.uint64, 2), (np.uint8, size))
            want = pool[offsets[expected] : offsets[expected] + size]
            if (
                kind != expected % 7
                or int(header[0]) != expected
                or int(header[1]) != zlib.crc32(body)
                or not np.array_equal(body, want)
            ):
                errors.append(f"record {expected}: kind {kind}, header {header.tolist()}")
                if len(errors) > 5:
                    break
            del header, body, payload, record
            expected += 1
            if expected % 16 == 0:
                ring.release()
        ring.release()
    report.put(("consumer", expected, errors))


def test_processes_move_every_record_once_in_order_through_a_small_ring(name):
    """20k records of random sizes wrap a 64 KiB ring hundreds of times, under backpressure."""
    count, seed = 20_000, 7
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    ring = Ring.create(name, 64 * 1024)
    producer = ctx.Process(target=produce, args=(name, seed, count, report))
    consumer = ctx.Process(target=consume, args=(name, seed, count, report))
    try:
        producer.start()
        # The consumer starts only once the producer has met a full ring: backpressure is certain.
        assert report.get(timeout=60)[0] == "full"
        assert ring.used_bytes > ring.capacity_bytes // 2
        consumer.start()
        results = {}
        deadline = time.monotonic() + 100
        while len(results) < 2:
            try:
                message = report.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no result within the deadline; have {results}")
            results[message[0]] = message[1:]
        assert results["consumer"] == (count, [])
        assert results["producer"][0] == "done"
        assert results["producer"][1] > 0  # put() returned None at least once
        assert ring.used_bytes == 0
        assert ring.head > 40 * ring.capacity_bytes  # it wrapped many times
        producer.join(30)
        consumer.join(30)
        assert (producer.exitcode, consumer.exitcode) == (0, 0)
    finally:
        for process in (producer, consumer):
            if process.is_alive():
                process.kill()
                process.join(10)
        report.close()
        report.join_thread()
        ring.close()


# ---- one process ---------------------------------------------------------------------------


def test_full_ring_returns_none_and_recovers_after_release(name):
    with Ring.create(name, 4096) as ring:
        record = np.arange(126, dtype=np.uint32)  # 504 bytes: 512 with the record header
        ends = []
        while (end := ring.put(5, record)) is not None:
            ends.append(end)
        assert len(ends) == 8 and ring.used_bytes == 4096 and ring.free_bytes == 0
        assert ends == [512 * (i + 1) for i in range(8)]
        kind, payload = ring.get()
        assert kind == 5 and np.array_equal(np.frombuffer(payload, np.uint32), record)
        assert ring.put(5, record) is None  # got, not yet released: still full
        del payload
        assert ring.release() == 512
        assert ring.put(6, record) == 512 * 9
        kinds = [kind for kind, _ in drain(ring)]
        assert kinds == [5] * 7 + [6]
        assert ring.used_bytes == 0


def test_record_that_would_straddle_the_end_wraps_to_the_start(name):
    with Ring.create(name, 1024) as ring:
        assert ring.put(1, b"a" * 400) == 408
        assert ring.put(2, b"b" * 400) == 816
        assert drain(ring) == [(1, b"a" * 400), (2, b"b" * 400)]
        # 208 bytes left before the end: a 408-byte record skips them and starts at 0.
        start = ring.head
        assert ring.put(3, b"c" * 400) == start + 208 + 408
        assert ring.used_bytes == 616  # the skipped 208 bytes count until the consumer passes them
        assert ring.put(4, b"d" * 400) == start + 208 + 816
        assert ring.used_bytes == 1024
        assert ring.put(5, b"e") is None
        assert drain(ring) == [(3, b"c" * 400), (4, b"d" * 400)]
        assert ring.put(5, b"e") == start + 208 + 816 + 16


def test_put_writes_several_arrays_that_record_arrays_reads_back(name):
    structured = np.zeros(3, dtype=[("seq", "<u8"), ("slot", "<u4"), ("lane", "<u2")])
    structured["seq"] = [10, 11, 12]
    strided = np.arange(40, dtype=np.int64).reshape(5, 8)[:, ::3]  # not contiguous: one copy
    with Ring.create(name, 8192) as ring:
        ring.put(9, structured, strided, np.zeros(0, np.float32), np.array([1, 2, 3], np.uint8))
        kind, payload = ring.get()
        assert kind == 9
        got = record_arrays(
            payload, (structured.dtype, 3), ("<i8", (5, 3)), ("<f4", 0), (np.uint8, 3)
        )
        assert np.array_equal(got[0], structured) and got[0].dtype == structured.dtype
        assert np.array_equal(got[1], strided)
        assert got[2].shape == (0,) and got[3].tolist() == [1, 2, 3]
        assert not got[1].flags.writeable  # consumer views are read-only
        with pytest.raises(RingError, match=r"payload is \d+ bytes but the layout"):
            record_arrays(payload, (np.uint8, 1))
        del got, payload
        ring.release()


def test_reserve_and_commit_publish_in_place(name):
    with Ring.create(name, 4096) as ring:
        view = ring.reserve(4, 10)
        view[:] = b"0123456789"
        assert ring.get() is None  # nothing is visible before commit
        assert ring.commit() == RECORD_HEADER_BYTES + 16
        kind, payload = ring.get()
        assert (kind, bytes(payload)) == (4, b"0123456789")
        with pytest.raises(RingError, match="commit"):
            ring.commit()
        ring.reserve(4, 1)
        with pytest.raises(RingError, match="reserve"):
            ring.reserve(4, 1)
        ring.cancel()
        del view, payload
        ring.release()
        assert ring.used_bytes == 0


def test_oversized_record_is_refused_naming_the_sizes(name):
    with Ring.create(name, 4096) as ring:
        assert ring.max_record_bytes == 2040
        assert ring.put(1, np.zeros(2040, np.uint8)) is not None
        with pytest.raises(RingError, match=r"2041 payload bytes \(2056 with header\).*4096"):
            ring.put(1, np.zeros(2041, np.uint8))
        with pytest.raises(RingError, match="objects"):
            ring.put(1, np.array([object()]))
        with pytest.raises(RingError, match="kind 4294967295"):
            ring.put(0xFFFFFFFF, b"x")


def test_attaching_to_a_missing_ring_names_it(tmp_path):
    missing = ring_name(tmp_path, "router", "writer", 3)
    with pytest.raises(RingError, match=f"ring {missing} does not exist"):
        Ring.attach(missing)


def test_attach_refuses_shared_memory_that_is_not_a_ring(name):
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=HEADER_BYTES + 64)
    shm.close_fd()
    with pytest.raises(RingError, match="bad magic"):
        Ring.attach(name)


def test_create_replaces_a_stale_ring_and_attach_sees_the_state(name):
    with Ring.create(name, 4096) as stale:
        stale.put(1, b"left over")
        with Ring.attach(name) as consumer:
            assert consumer.used_bytes == 24
            assert consumer.get()[0] == 1
        with Ring.create(name, 8192) as fresh, Ring.attach(name) as consumer:
            assert consumer.capacity_bytes == 8192
            assert consumer.created_ns == fresh.created_ns > stale.created_ns
            assert consumer.used_bytes == 0 and consumer.get() is None
            assert fresh.put(2, b"new") == 16
            assert drain(consumer) == [(2, b"new")]
        assert stale.used_bytes == 24  # the old mapping lives on, detached from the name


def test_a_restarted_consumer_reads_unreleased_records_again(name):
    with Ring.create(name, 4096) as producer:
        for kind in range(3):
            producer.put(kind, bytes([kind]) * 8)
        with Ring.attach(name) as first:
            assert first.get()[0] == 0
            first.release()
            assert first.get()[0] == 1  # read, never released: the consumer dies here
        with Ring.attach(name) as second:
            assert [kind for kind, _ in drain(second)] == [1, 2]


def test_close_with_views_still_held_keeps_them_readable(name):
    ring = Ring.create(name, 4096)
    ring.put(1, b"still here")
    _, payload = ring.get()
    ring.close()
    ring.close()  # idempotent
    assert bytes(payload) == b"still here"
    with pytest.raises(RingError, match="closed"):
        ring.get()


def test_create_refuses_bad_capacities_and_names(name):
    for capacity in (0, 100, 4097, 4096.0):
        with pytest.raises(RingError, match=f"capacity_bytes {capacity!r}"):
            Ring.create(name, capacity)
    for bad in ("no-slash", "/a/b", "/" + "x" * 30, "/", 7):
        with pytest.raises(RingError, match="not a portable POSIX"):
            Ring.create(bad, 4096)


def test_ring_names_are_short_valid_and_distinct(tmp_path):
    names = set()
    for directory in (tmp_path / "a", tmp_path / "b", tmp_path / ("long" * 40)):
        for src, dst in (("ingest", "router"), ("router", "writer"), ("tokeniser", "router")):
            for n in (0, 1, 999_999):
                names.add(ring_name(directory, src, dst, n))
    assert len(names) == 3 * 3 * 3
    for ring in names:
        assert ring.startswith("/") and "/" not in ring[1:] and len(ring) <= NAME_MAX_CHARS
    assert ring_name(tmp_path, "router", "writer", 0).endswith(".router.writer.0")
    # Same dir spelled two ways is the same broker.
    assert ring_name(tmp_path / "a" / ".." / "b", "x", "y", 1) == ring_name(
        tmp_path / "b", "x", "y", 1
    )
    for src, n in (("Router", 0), ("", 0), ("a.b", 0), ("router", -1), ("router", 10**6)):
        with pytest.raises(RingError, match=r"stage name|ring number"):
            ring_name(tmp_path, src, "writer", n)


# ---- benchmark (not a test) ------------------------------------------------------------


def bench_consumer(ring_name_: str, count: int, report) -> None:
    with Ring.attach(ring_name_) as ring:
        got = checksum = 0
        while got < count:
            record = ring.get()
            if record is None:
                ring.release()
                os.sched_yield()
                continue
            checksum ^= int(np.frombuffer(record[1], np.uint64)[-1])  # touch the record
            got += 1
            if got % 8 == 0:
                ring.release()
        ring.release()
    report.put((time.perf_counter(), checksum))


def bench(record_kib: int = 64, total_mib: int = 4096) -> None:
    """Two processes move `total_mib` of `record_kib` records through a 16 MiB ring."""
    name = ring_name("/tmp/ring-bench", "bench", "ring", os.getpid() % 10**6)
    record = np.random.default_rng(0).integers(0, 256, record_kib * 1024, dtype=np.uint8)
    count = total_mib * 1024 // record_kib
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    with Ring.create(name, 16 << 20) as ring:
        consumer = ctx.Process(target=bench_consumer, args=(name, count, report))
        consumer.start()
        start = time.perf_counter()
        for _ in range(count):
            while ring.put(1, record) is None:
                os.sched_yield()
        end, _ = report.get(timeout=600)
        consumer.join()
    Ring.unlink(name)
    seconds = end - start
    print(
        f"{count} records x {record_kib} KiB, producer -> consumer process, 16 MiB ring: "
        f"{count * record.nbytes / seconds / 1e9:.2f} GB/s, "
        f"{seconds / count * 1e6:.1f} us/record ({os.cpu_count()} CPUs, {sys.platform})"
    )


if __name__ == "__main__":
    bench(*(int(arg) for arg in sys.argv[1:]))


def test_a_replaced_ring_is_told_apart_by_its_creation_time_without_mapping_it():
    name = "/iftest.port.check.0"
    first = Ring.create(name, 4096)
    try:
        assert Ring.created_ns_of(name) == first.created_ns
        second = Ring.create(name, 4096)  # the supervisor replacing it
        assert Ring.created_ns_of(name) == second.created_ns != first.created_ns
        second.close()
    finally:
        first.close()
        Ring.unlink(name)
    assert Ring.created_ns_of(name) is None


def _create_elsewhere(name: str) -> None:
    Ring.create(name, 4096).close()


def test_a_port_re_attaches_its_own_supervisor_s_replacement_but_not_another_broker_life_s():
    """A stage's port follows a ring its supervisor replaced; a ring created again by another
    process is a newer broker life's (the stage outlived its own, which ended): joining it
    would make two consumers of one ring, each writer appending every record (chaos seed
    33071's chaos-0021, each chunk stored twice), so the port raises and the stage stops."""
    name = "/iftest.port.life.0"
    port = RingPort(name, check_s=0.0)
    try:
        first = Ring.create(name, 4096)
        assert port.get() is not None and port.ring.created_ns == first.created_ns
        second = Ring.create(name, 4096)  # this process (the supervisor) replacing it
        assert port.get().created_ns == second.created_ns
        newer_life = multiprocessing.get_context("fork").Process(
            target=_create_elsewhere, args=(name,)
        )
        newer_life.start()
        newer_life.join(30)
        assert newer_life.exitcode == 0
        with pytest.raises(RingError, match="newer broker life"):
            port.get()
        assert port.ring is None
        first.close()
        second.close()
    finally:
        port.close()
        Ring.unlink(name)
