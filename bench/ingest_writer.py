"""The segment writer alone, a diagnostic for step 2 of bench/ingest.py: where its time goes.

Run from the repository root (about 20 s; writes ~1 GB under the bench dir, then removes it):

    .venv/bin/python bench/ingest_writer.py [--items N] [--repeat K] [--dir PATH]

One `WriterStage` (router/writer_stage.py, default settings, 256 MiB segments)
is stepped in this process; a child process fills its ring with KEYED records
of 1024 items of 512 tokens (the same 2080-byte slots as step 2) and wakes it,
as a router does. No front, tokeniser or producer: what is left is the writer
and the disk. Per repeat it prints the disk's own pwrite+fdatasync bandwidth
(bench/disk.py, 8 MiB chunks, measured just before), the writer's durable
items/s and their share of the disk, the writer process's CPU per item, and
how the writer's thread spent its wall time: appending (Segment.append),
waiting for the disk (the last step's sync not back when the next is ready),
waiting for records, and the fdatasyncs on the sync thread, which overlap the
appends. Timers wrap those calls in this process; nothing is written to docs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq

from config.stage_settings import stage_settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import disk
from bench.ingest_broker import Model, write_config
from bench.ingest_common import SLOT_BYTES, TOKENS
from config import load_settings
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.transport import wire
from pipeline.transport.ring import Ring
from pipeline.transport.ring_records import Keyed, put_keyed
from pipeline.transport.topology import internal_address, rings_to
from router.sync_thread import SyncThread
from router.writer_stage import WriterStage

REPO = Path(__file__).resolve().parent.parent
RECORD_ITEMS = 1024
RING_BYTES = 64 << 20
spent: Counter = Counter()  # seconds in each timed call, on the writer's thread


def timed(name: str, function):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - began

    return wrapper


def feed(ring_name: str, wakeup: str, items: int) -> None:
    """The child process: put `items` items into the writer's ring, waking it per record."""
    ring = Ring.attach(ring_name)
    context = zmq.Context()
    push = wire.open_socket(context, zmq.PUSH, connect=wakeup)
    tokens = np.random.default_rng(1).integers(1, 30_000, (RECORD_ITEMS, TOKENS), np.uint32)
    lengths = np.full(RECORD_ITEMS, TOKENS, np.uint32)
    pause = threading.Event()
    for k in range(items // RECORD_ITEMS):
        index = np.arange(k * RECORD_ITEMS, (k + 1) * RECORD_ITEMS, dtype=np.uint32)
        record = Keyed(1, k, 2**62, "echo", 1, TOKENS, index, lengths, tokens)
        while put_keyed(ring, record) is None:  # the writer is behind: wait for room
            pause.wait(0.0005)
        meta = {"ring": ring_name, "start": 0, "end": 0, "count": 0}
        wire.send(push, wire.MessageType.ITEM_BATCH, meta)
    push.close(0)
    context.term()


def one_run(root: Path, items: int) -> dict[str, float]:
    root.mkdir(parents=True)
    disk_mb_s = disk.write_bandwidth(root / "disk.raw", 8 << 20, 512 << 20) / 1e6
    (root / "disk.raw").unlink(missing_ok=True)
    (root / "writer").mkdir()
    settings = load_settings(write_config(root / "writer", [Model("echo")]))
    DataDir(settings.data_path).ensure()
    (spec,) = rings_to(settings, "writer-0")
    ring = Ring.create(spec.name, RING_BYTES)
    stage = WriterStage(stage_settings(settings, "writer"), 0)
    stage.open()
    context = zmq.Context()
    front = wire.open_socket(context, zmq.PULL, bind=internal_address(settings, "front"))
    done = threading.Event()

    def drain_answers() -> None:
        while not done.is_set():
            while front.poll(50):
                front.recv_multipart()

    answers = threading.Thread(target=drain_answers, daemon=True)
    answers.start()
    wakeup = internal_address(settings, "writer-0")
    feeder = mp.get_context("fork").Process(target=feed, args=(spec.name, wakeup, items))
    spent.clear()
    fsync_before = stage.fsync_s.sum
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    began = time.perf_counter()
    feeder.start()
    try:
        while stage.appended < items:
            stage.step(time.monotonic())
        seconds = time.perf_counter() - began
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        feeder.join()
    finally:
        done.set()
        answers.join()
        front.close(0)
        context.term()
        stage.close()
        ring.close()
        Ring.unlink(spec.name)
    cpu = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
    rate = items / seconds
    return {
        "disk MB/s": disk_mb_s,
        "writer items/s": rate,
        "share of the disk": rate * SLOT_BYTES / 1e6 / disk_mb_s,
        "writer CPU us/item (both threads)": cpu / items * 1e6,
        "wall s": seconds,
        "appending s": spent["append"],
        "waiting for the disk s": spent["collect"],
        "waiting for records s": spent["wait"],
        "fdatasync on the sync thread s": stage.fsync_s.sum - fsync_before,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=409_600)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-writer")
    args = parser.parse_args()
    Segment.append = timed("append", Segment.append)
    SyncThread.collect = timed("collect", SyncThread.collect)
    WriterStage._wait = timed("wait", WriterStage._wait)
    root = args.dir / f"writer-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        for k in range(args.repeat):
            run = one_run(root / str(k), args.items)
            print(
                f"run {k + 1}: " + ", ".join(f"{name} {value:,.3g}" for name, value in run.items())
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
