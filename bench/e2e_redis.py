"""Step 2 of bench/e2e.py: the same end-to-end workload through Redis Streams.

    producer (this process) --XADD--> items --XREADGROUP (2 consumers)--> XADD results, XACK
    reader --XREAD results--> OUT (one OpenAI-Batch-shaped line per result, fdatasync per read)

One `redis-server` (bench/ingest_redis.py: AOF with `appendfsync everysec`).
The group is created on an empty stream, then two consumer processes and
one reader process start and block on their reads; the clock starts at the
first XADD and stops when the reader has written and fsynced N lines and
exited. A consumer's result for an item is what the echo worker returns
for it: the first 16 token ids (max_tokens 16), as 64 bytes.

Each role is a process of its own (`python bench/e2e_redis.py consumer|reader
...`) with a small RESP client (`Resp`): commands pipelined, replies parsed
into bytes, ints and lists.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ingest_redis import BATCH, RedisServer, _encode, _read_replies

ITEMS = b"items"
RESULTS = b"results"
GROUP = b"workers"
RESULT_TOKENS = 16  # max_tokens of the fabric's workload: echo returns the first 16 tokens
READ_COUNT = 4096
BLOCK_MS = b"200"
CUSTOM_ID_WIDTH = 13  # b"item-%08d"
COUNT_BLOCK = (b"COUNT", b"%d" % BATCH, b"BLOCK", BLOCK_MS)  # a consumer's read
READ_BLOCK = (b"COUNT", b"%d" % READ_COUNT, b"BLOCK", BLOCK_MS)  # the reader's


class RespError(RuntimeError):
    """redis-server answered a command with an error."""


class Resp:
    """A RESP2 connection: `send(*commands)` pipelines, `read()` parses one reply."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0

    def send(self, *commands: tuple[bytes, ...]) -> None:
        self.sock.sendall(b"".join(_encode(c) for c in commands))

    def _fill(self) -> None:
        if self.pos > len(self.buf) // 2:  # drop what was parsed, now and then
            del self.buf[: self.pos]
            self.pos = 0
        data = self.sock.recv(1 << 22)
        if not data:
            raise RespError("redis-server closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            self._fill()
        line = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return line

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            while len(self.buf) < self.pos + size + 2:
                self._fill()
            value = bytes(memoryview(self.buf)[self.pos : self.pos + size])
            self.pos += size + 2
            return value
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self.read() for _ in range(size)]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        raise RespError(rest.decode(errors="replace"))


# ---- the producer (in bench/e2e.py's process) ---------------------------------------------
def xadd_items(rows: np.ndarray, first: int) -> np.ndarray:
    """Pipelined `XADD items * c item-<8 digits> t <row bytes>` for rows, as one byte array."""
    n, value = rows.shape[0], rows.shape[1] * 4
    head = b"*7\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\nc\r\n$%d\r\n" % (
        len(ITEMS),
        ITEMS,
        CUSTOM_ID_WIDTH,
    )
    middle = b"\r\n$1\r\nt\r\n$%d\r\n" % value
    ids = np.array([b"item-%08d" % i for i in range(first, first + n)], f"S{CUSTOM_ID_WIDTH}")
    widths = (len(head), CUSTOM_ID_WIDTH, len(middle), value, 2)
    at = np.cumsum((0, *widths))
    out = np.empty((n, at[-1]), np.uint8)
    out[:, at[0] : at[1]] = np.frombuffer(head, np.uint8)
    out[:, at[1] : at[2]] = ids.view(np.uint8).reshape(n, CUSTOM_ID_WIDTH)
    out[:, at[2] : at[3]] = np.frombuffer(middle, np.uint8)
    out[:, at[3] : at[4]] = np.ascontiguousarray(rows).view(np.uint8)
    out[:, at[4] :] = (13, 10)
    return out


def produce(server: RedisServer, rows: np.ndarray) -> float:
    """XADD every row, BATCH per pipeline round; seconds from the first send to the last reply."""
    started = time.perf_counter()
    for start in range(0, rows.shape[0], BATCH):
        batch = xadd_items(rows[start : start + BATCH], start)
        server.sock.sendall(memoryview(batch).cast("B"))
        _read_replies(server.sock, batch.shape[0])
    return time.perf_counter() - started


# ---- the consumer and reader processes ----------------------------------------------------
_stop = {"flag": False}


def _on_term(signum: int, frame: object) -> None:
    _stop["flag"] = True


def consume(port: int, name: bytes) -> int:
    """XREADGROUP a batch, XADD one result per item, XACK the batch; until SIGTERM."""
    conn = Resp(port)
    handled = 0
    while not _stop["flag"]:
        conn.send((b"XREADGROUP", b"GROUP", GROUP, name, *COUNT_BLOCK, b"STREAMS", ITEMS, b">"))
        reply = conn.read()
        if not reply:
            continue
        entries = reply[0][1]
        commands = []
        ids = []
        for entry_id, fields in entries:
            values = dict(zip(fields[::2], fields[1::2], strict=True))
            result = values[b"t"][: 4 * RESULT_TOKENS]
            commands.append(
                (b"XADD", RESULTS, b"*", b"i", entry_id, b"c", values[b"c"], b"r", result)
            )
            ids.append(entry_id)
        commands.append((b"XACK", ITEMS, GROUP, *ids))
        conn.send(*commands)
        for _ in commands:
            conn.read()
        handled += len(ids)
    return handled


def read_results(port: int, n: int, out_path: Path, created: int) -> int:
    """XREAD results from the start and write one line per result, fdatasync per read."""
    import orjson

    conn = Resp(port)
    last = b"0-0"
    written = 0
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while written < n and not _stop["flag"]:
            conn.send((b"XREAD", *READ_BLOCK, b"STREAMS", RESULTS, last))
            reply = conn.read()
            if not reply:
                continue
            entries = reply[0][1]
            lines = []
            for entry_id, fields in entries:
                values = dict(zip(fields[::2], fields[1::2], strict=True))
                item = values[b"i"].decode()
                tokens = np.frombuffer(values[b"r"], "<u4").tolist()
                lines.append(orjson.dumps(_line(item, values[b"c"].decode(), tokens, created)))
                last = entry_id
            os.write(fd, b"\n".join(lines) + b"\n")
            os.fdatasync(fd)
            written += len(lines)
    finally:
        os.close(fd)
    return written


def _line(item: str, custom_id: str, tokens: list[int], created: int) -> dict:
    """The shape of the fabric's output line for a /v1/completions result (collector/delivery/lines.py)."""
    return {
        "id": "batch_req_" + item,
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": item,
            "body": {
                "id": "cmpl-" + item,
                "object": "text_completion",
                "created": created,
                "model": "echo",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": "length",
                        "token_ids": tokens,
                    }
                ],
                "usage": {
                    "prompt_tokens": 512,
                    "completion_tokens": len(tokens),
                    "total_tokens": 512 + len(tokens),
                },
            },
        },
        "error": None,
    }


# ---- one timed run (in bench/e2e.py's process) ---------------------------------------------
def run_once(binary: str, root: Path, rows: np.ndarray, consumers: int = 2) -> dict:
    """One fresh server; seconds from the first XADD until the reader exited, and its numbers."""
    server = RedisServer(binary, root)
    procs: list[subprocess.Popen] = []
    try:
        server.command(b"XGROUP", b"CREATE", ITEMS, GROUP, b"$", b"MKSTREAM")
        me = str(Path(__file__).resolve())
        port, items = str(server.port), str(len(rows))
        for k in range(consumers):
            procs.append(
                subprocess.Popen(
                    [sys.executable, me, "consumer", "--port", port, "--name", f"c{k}"]
                )
            )
        out = root / "out.jsonl"
        reader = subprocess.Popen(
            [sys.executable, me, "reader", "--port", port, "--items", items, "--out", str(out)]
        )
        procs.append(reader)
        _wait_blocked(server.port, consumers + 1)
        started = time.perf_counter()
        produce_s = produce(server, rows)
        if reader.wait(timeout=600) != 0:
            raise RuntimeError(f"the Redis results reader exited with {reader.returncode}")
        seconds = time.perf_counter() - started
        rss = server.rss_bytes()
        aof = server.aof_bytes()
        lines = _count_lines(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.close()
    return {"seconds": seconds, "produce_s": produce_s, "rss": rss, "aof": aof, "lines": lines}


def _wait_blocked(port: int, n: int, timeout_s: float = 60.0) -> None:
    """Until `n` clients wait in XREAD or XREADGROUP (CLIENT LIST names each one's command)."""
    conn = Resp(port)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            conn.send((b"CLIENT", b"LIST"))
            if conn.read().count(b" cmd=xread") >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} Redis consumers and reader not connected in {timeout_s} s")
            time.sleep(0.02)
    finally:
        conn.sock.close()


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a consumer or the reader of bench/e2e.py")
    parser.add_argument("role", choices=("consumer", "reader"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="c0")
    parser.add_argument("--items", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    if args.role == "consumer":
        consume(args.port, args.name.encode())
    else:
        read_results(args.port, args.items, args.out, int(time.time()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
