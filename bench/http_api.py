"""The OpenAI Batch API over HTTP (api/): upload throughput and memory, and a batch end to end.

1. Upload: a batch file of --size bytes (1 GiB by default; lines of about 1 KiB,
   each a valid request) is uploaded with the official openai client
   (`files.create`), timed until the File object comes back (the file is
   fsynced by then). It is judged against the disk's own durable sequential
   write bandwidth measured in the same run on the same file system
   (bench/disk.py: pwrite + fdatasync), and the api stage's RSS is sampled
   every 0.1 s: its growth during the upload is peak minus the value before.
2. End to end: --lines echo requests (100,000 by default), once through HTTP
   (upload -> batches.create -> batches.retrieve every 0.2 s until completed ->
   the output file downloaded) and once through the command line (`run.py
   submit FILE` then `run.py results JOB -o OUT --follow`), each on a fresh
   broker with one local echo worker; items per second of each, from the first
   byte sent to the last result on disk.

    python -m bench.http_api [--size BYTES] [--lines N] [--repeat R] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench import machine
from bench.disk import write_bandwidth
from bench.dispatch_common import pressure
from bench.ingest_broker import REPO, BenchBroker, Model, RssSampler
from bench.report import Row, render_section, write_section
from pipeline.transport.ports import free_loopback_ports

DOC = REPO / "docs" / "BENCHMARKS.md"
SECTION = "http-api"
MODEL = Model("echo", endpoints=("/v1/completions",))
ENDPOINT = "/v1/completions"
LINE_PAD = 900  # bytes of prompt ids per upload line: lines of about 1 KiB
RUN_TIMEOUT_S = 1800.0


def progress(text: str) -> None:
    print(f"[http_api] {text}", file=sys.stderr, flush=True)


def broker_for(root: Path, workers: int) -> tuple[BenchBroker, str]:
    port, vectors = free_loopback_ports(2)
    sections = {
        "api": {"enabled": True, "bind": f"127.0.0.1:{port}"},
        "vectors": {"bind": f"tcp://127.0.0.1:{vectors}"},
        "workers": {"local": workers},
        "metrics": {"bind": ""},
    }
    return BenchBroker(root, [MODEL], sections=sections), f"http://127.0.0.1:{port}/v1"


def client_for(url: str):
    import openai

    return openai.OpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600)


def request_line(i: int, tokens: int) -> bytes:
    ids = [1 + (i + k) % 30000 for k in range(tokens)]
    body = {"model": MODEL.name, "prompt_token_ids": ids, "max_tokens": 16}
    line = {"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": body}
    return orjson.dumps(line) + b"\n"


def write_requests(path: Path, lines: int | None, size: int | None, tokens: int) -> int:
    """`lines` requests, or as many as fill `size` bytes; returns the lines written."""
    written = 0
    with open(path, "wb", buffering=1 << 20) as out:
        i = 0
        while (lines is not None and i < lines) or (size is not None and written < size):
            line = request_line(i, tokens)
            out.write(line)
            written += len(line)
            i += 1
    return i


def count_lines(path: Path) -> int:
    with open(path, "rb") as lines:
        return sum(1 for _ in lines)


def bench_upload(root: Path, size: int) -> dict[str, float]:
    path = root / "upload.jsonl"
    write_requests(path, None, size, LINE_PAD // 6)
    size = path.stat().st_size
    broker, url = broker_for(root / "broker-upload", workers=0)
    broker.start()
    try:
        disk = write_bandwidth(broker.data / "disk-probe", 1 << 20, min(size, 1 << 30))
        client = client_for(url)
        api = broker.pids()["api-0"]
        with RssSampler(api, every_s=0.1) as rss:
            time.sleep(0.3)
            before = rss.samples[-1][1].get(api, 0)
            started = time.perf_counter()
            with open(path, "rb") as data:
                client.files.create(file=("upload.jsonl", data), purpose="batch")
            seconds = time.perf_counter() - started
            ended = time.monotonic()
        peak = max(s.get(api, 0) for t, s in rss.samples if t <= ended)
        broker.stop()
        return {
            "bytes": size,
            "upload_bps": size / seconds,
            "disk_bps": disk,
            "rss_growth": max(0, peak - before),
            "rss_before": before,
        }
    finally:
        broker.close()
        path.unlink(missing_ok=True)


def bench_http(root: Path, source: Path, lines: int) -> float:
    """Seconds from upload to the output file on disk, through the HTTP API."""
    broker, url = broker_for(root / "broker-http", workers=1)
    broker.start()
    try:
        client = client_for(url)
        started = time.perf_counter()
        with open(source, "rb") as data:
            file = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint=ENDPOINT, completion_window="24h"
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch.id} still {batch.status} after the timeout")
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        if batch.status != "completed" or batch.request_counts.completed != lines:
            raise RuntimeError(f"batch {batch.id} ended {batch.status}: {batch.request_counts}")
        out = root / "http-out.jsonl"
        client.files.content(batch.output_file_id).write_to_file(out)
        seconds = time.perf_counter() - started
        got = count_lines(out)
        if got != lines:
            raise RuntimeError(f"the HTTP output has {got} lines, not {lines}")
        broker.stop()
        return seconds
    finally:
        broker.close()


def bench_cli(root: Path, source: Path, lines: int) -> float:
    """Seconds from `run.py submit` to `run.py results --follow` ending, the same lines."""
    broker, _ = broker_for(root / "broker-cli", workers=1)
    broker.start()
    try:
        run = [sys.executable, str(REPO / "run.py")]
        config = ["--config", str(broker.config)]
        out, err = root / "cli-out.jsonl", root / "cli-err.jsonl"
        started = time.perf_counter()
        job = subprocess.run(
            [*run, "submit", str(source), *config, "--job-id", "cli"],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            timeout=RUN_TIMEOUT_S,
        ).stdout.strip()
        subprocess.run(
            [*run, "results", job, "-o", str(out), "--errors", str(err), "--follow", *config],
            capture_output=True,
            check=True,
            cwd=REPO,
            timeout=RUN_TIMEOUT_S,
        )
        seconds = time.perf_counter() - started
        got = count_lines(out)
        if got != lines:
            raise RuntimeError(f"the CLI output has {got} lines, not {lines}")
        broker.stop()
        return seconds
    finally:
        broker.close()


def http_parser() -> str:
    """The HTTP/1.1 parser uvicorn runs the api stage with: httptools when installed, else h11."""
    try:
        import httptools
    except ImportError:
        import h11

        return f"h11 {h11.__version__} (httptools not installed)"
    return f"httptools {httptools.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, default=1 << 30, help="upload bytes (1 GiB)")
    parser.add_argument("--lines", type=int, default=100_000, help="echo batch lines")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-http-api")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args(argv)
    if args.size < 1 << 20 or args.lines < 1000 or args.repeat < 1:
        parser.error("need --size >= 1 MiB, --lines >= 1000 and --repeat >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"http-{os.getpid()}"
    root.mkdir()
    facts = machine.describe(args.dir)
    facts["CPU and I/O pressure at start"] = pressure()
    facts["HTTP parser (uvicorn's pick)"] = http_parser()
    started = time.perf_counter()
    uploads, http, cli = [], [], []
    try:
        source = root / "batch.jsonl"
        write_requests(source, args.lines, None, 16)
        for r in range(args.repeat):
            progress(f"repeat {r + 1}: upload of {args.size:,} bytes")
            uploads.append(bench_upload(root, args.size))
            progress(f"repeat {r + 1}: {args.lines:,} lines through HTTP")
            http.append(args.lines / bench_http(root, source, args.lines))
            progress(f"repeat {r + 1}: {args.lines:,} lines through run.py submit/results")
            cli.append(args.lines / bench_cli(root, source, args.lines))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    facts["load average at end"] = machine.load_average()
    mib = 1 << 20
    rows = [
        Row(
            "upload", "MiB/s through POST /v1/files", tuple(u["upload_bps"] / mib for u in uploads)
        ),
        Row("upload", "disk's durable write MiB/s", tuple(u["disk_bps"] / mib for u in uploads)),
        Row(
            "upload",
            "upload / disk bandwidth",
            tuple(u["upload_bps"] / u["disk_bps"] for u in uploads),
            percent=True,
            target=">= 50%",
            at_least=0.5,
        ),
        Row(
            "upload",
            "api stage RSS growth, MiB",
            tuple(u["rss_growth"] / mib for u in uploads),
            target="< 64 MiB",
            below=64,
        ),
        Row("end to end", "items/s through HTTP", tuple(http)),
        Row("end to end", "items/s through run.py submit + results", tuple(cli)),
        Row(
            "end to end",
            "HTTP / CLI items/s",
            tuple(h / c for h, c in zip(http, cli, strict=True)),
            percent=True,
            target=">= 80%",
            at_least=0.8,
        ),
    ]
    notes = [
        f"Upload: {uploads[0]['bytes']:,} bytes of JSONL (lines of about 1 KiB), openai-python "
        "`files.create` on the same host; timed until the File object came back (the bytes "
        "and the record fsynced). The disk figure is bench/disk.py's pwrite + fdatasync per "
        "1 MiB chunk, on the broker's data dir, in the same run.",
        f"RSS of api-0 before the upload: {uploads[0]['rss_before'] / mib:.0f} MiB.",
        f"End to end: {args.lines:,} echo /v1/completions lines of 16 token ids, one local echo "
        "worker, a fresh broker each; HTTP polls batches.retrieve every 0.2 s and downloads the "
        "output file; the CLI runs `submit`, then `results --follow` (one after the other, as a "
        "user would). Each path parses the file once and overlaps that with the broker's "
        "work: HTTP's validation sends each chunk as it checks out (api/batch_validation.py).",
        f"Sizes: --size {args.size:,} ({args.size / mib:,.0f} MiB"
        + (", not the default 1 GiB" if args.size != 1 << 30 else "")
        + f"), --lines {args.lines:,}, --repeat {args.repeat}. On a shared machine the "
        "end-to-end figures move with the load (its averages above, at start and end).",
    ]
    body = render_section(
        "OpenAI Batch API over HTTP (bench/http_api.py)",
        "Upload throughput and memory of the api stage, and one echo batch through HTTP against "
        "the same lines through the command line.",
        machine.command_line(),
        time.perf_counter() - started,
        facts,
        rows,
        notes,
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, SECTION, body)
        progress(f"rewrote its section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
