"""The same workload into Redis Streams: a redis-server on loopback and a minimal RESP client.

`RedisServer(root)` starts `redis-server` in `root` on a free loopback
port with an append-only file fsynced once a second (`--appendonly yes
--appendfsync everysec --save ""`, automatic AOF rewrites off so that no
fork lands inside a timed run); `close()` shuts it down and removes `root`.

`xadd_all(server, key, rows)` XADDs every row of a 2-D uint32 array as one
entry (`XADD key * t <row bytes>`), pipelined in batches of `BATCH`: one
send of the whole batch, then read until every reply is in. Replies are
counted, not parsed: a bulk reply (the entry id) holds two CRLFs and an
error starts a line with '-', which an id never does. Each batch's
commands are built with numpy (a fixed header per row, then the row's
bytes), so the client spends its time in the socket, not in Python.

`bench_redis` is step 3 of bench/ingest.py: the same rows as step 2, into a
fresh server per repeat (the ratio to Inference Fabric is judged on these),
then into one server that keeps every repeat's stream.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.ingest_broker import free_port, rss_bytes
from bench.ingest_common import Outcome, Plan, progress
from bench.report import Row

BATCH = 1024
BYTES_PER_ITEM = 2300  # redis-server memory (and AOF) per 2 KiB entry, with room to spare
RATIO_TARGET = 5.0
STEP = "3 redis"
CONFIG = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "")
START_TIMEOUT_S = 30.0


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def redis_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return out.strip()


class RedisServer:
    """One redis-server process with its files under `root`."""

    def __init__(self, binary: str, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(root),
                *CONFIG,
                "--auto-aof-rewrite-percentage",
                "0",
                "--logfile",
                str(root / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return sock
                sock.close()
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.root / 'redis.log'}")
            time.sleep(0.05)

    def command(self, *args: bytes) -> bytes:
        """One command; the first line of its reply (enough for PING, DEL, XLEN)."""
        self.sock.sendall(_encode(args))
        reply = b""
        while not reply.endswith(b"\r\n"):
            reply += self.sock.recv(1 << 16)
        return reply

    def rss_bytes(self) -> int:
        return rss_bytes(self.proc.pid)

    def aof_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.aof") if p.is_file())

    def close(self) -> None:
        """Shut the server down and remove its files. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.sock.sendall(_encode((b"SHUTDOWN", b"NOSAVE")))
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.sock.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _encode(args: tuple[bytes, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
    return b"".join(parts)


def xadd_batch(key: bytes, rows: np.ndarray) -> np.ndarray:
    """The pipelined XADD commands for `rows` ([n, width] uint32), as one byte array."""
    n = rows.shape[0]
    value = rows.shape[1] * 4
    head = np.frombuffer(
        b"*5\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\nt\r\n$%d\r\n" % (len(key), key, value),
        np.uint8,
    )
    out = np.empty((n, len(head) + value + 2), np.uint8)
    out[:, : len(head)] = head
    out[:, len(head) : len(head) + value] = np.ascontiguousarray(rows).view(np.uint8)
    out[:, -2:] = (13, 10)
    return out


def xadd_all(server: RedisServer, key: bytes, rows: np.ndarray) -> float:
    """XADD every row, BATCH per pipeline round; seconds from the first send to the last reply."""
    sock = server.sock
    started = time.perf_counter()
    for start in range(0, rows.shape[0], BATCH):
        batch = xadd_batch(key, rows[start : start + BATCH])
        sock.sendall(memoryview(batch).cast("B"))
        _read_replies(sock, batch.shape[0])
    return time.perf_counter() - started


def _read_replies(sock: socket.socket, n: int) -> None:
    """Read the replies to n XADDs; raise on an error reply."""
    wanted = 2 * n  # "$<len>\r\n<id>\r\n"
    seen, last = 0, b"\n"  # the byte before this read's first one
    while seen < wanted:
        data = sock.recv(1 << 20)
        if not data:
            raise RuntimeError("redis-server closed the connection")
        if b"\n-" in data or (last == b"\n" and data[:1] == b"-"):
            line = data[max(0, data.find(b"-")) :].split(b"\r\n", 1)[0]
            raise RuntimeError(f"redis refused an XADD: {line.decode(errors='replace')}")
        seen += data.count(b"\r\n") + (last == b"\r" and data[:1] == b"\n")
        last = data[-1:]


def bench_redis(
    plan: Plan, rows: np.ndarray, fabric_rates: tuple[float, ...], outcome: Outcome
) -> list[Row]:
    """Step 3: the same rows into Redis Streams, a fresh server per repeat, then one server for all.

    The fresh servers give Redis its best case (an empty, small process each
    time) and the ratio to Inference Fabric is judged on them, paired by
    repeat. One server taking every repeat, each stream kept like the
    broker's backlog, shows what a growing in-memory backlog costs.
    """
    binary = redis_binary()
    if binary is None:
        outcome.notes.append("Step 3 skipped: redis-server is not installed.")
        return []
    n = rows.shape[0]
    fresh, fresh_rss = [], []
    for k in range(plan.repeat):
        server = RedisServer(binary, plan.root / f"redis-{k}")
        try:
            fresh.append(n / xadd_all(server, b"bench", rows))
            fresh_rss.append(server.rss_bytes() / 2**20)
        finally:
            server.close()
        progress(f"step 3: fresh server {k + 1} of {plan.repeat}: {fresh[-1]:,.0f} items/s")
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    keep = plan.repeat * n * BYTES_PER_ITEM < available // 2
    kept, kept_rss = [], []
    server = RedisServer(binary, plan.root / "redis-kept")
    try:
        for k in range(plan.repeat):
            key = b"bench-%d" % k
            kept.append(n / xadd_all(server, key, rows))
            kept_rss.append(server.rss_bytes() / 2**20)
            if not keep:
                server.command(b"DEL", key)
            progress(f"step 3: one server, run {k + 1} of {plan.repeat}: {kept[-1]:,.0f} items/s")
        aof_gib = server.aof_bytes() / 2**30
    finally:
        server.close()
    backlog = "each run's stream kept" if keep else "each stream deleted after its run (RAM)"
    outcome.notes.append(
        f'Redis {redis_version(binary)}: `redis-server {" ".join(CONFIG[:4])} --save "" '
        "--auto-aof-rewrite-percentage 0` (no AOF rewrite fork inside a run). The client is "
        "this process: each batch of 1024 XADDs is built with numpy, sent in one write, and "
        "its replies are counted (two CRLFs each) before the next batch is sent. Fresh "
        f"servers: one per repeat, removed after it. One server: {backlog}; its AOF reached "
        f"{aof_gib:.1f} GiB."
    )
    return [
        Row(
            STEP,
            "XADD items/s, a fresh server per repeat (acknowledged before fsync: with "
            "appendfsync everysec it may lose up to 1 s)",
            tuple(fresh),
        ),
        Row(
            STEP,
            "ratio Inference Fabric / Redis items/s, paired by repeat",
            tuple(f / r for f, r in zip(fabric_rates, fresh, strict=True)),
            target=f">= {RATIO_TARGET:g}x",
            at_least=RATIO_TARGET,
        ),
        Row(STEP, "redis-server RSS after a fresh server's run, MiB", tuple(fresh_rss)),
        Row(STEP, "XADD items/s, one server for every repeat (backlog in RAM)", tuple(kept)),
        Row(
            STEP,
            f"redis-server RSS after run {plan.repeat} of one server, MiB",
            (kept_rss[-1],),
        ),
    ]
