"""`python run.py demo`: the real pipeline on a real model, with nothing downloaded.

It starts a broker of its own (data dir `var/demo/data`, kept between runs,
loopback ports picked free), with local `minilm` workers; submits a corpus
of real text that every CPython ships (the paragraphs of the Python
documentation topics in `pydoc_data`); shows progress for submit and
completion; delivers the embeddings to a vector store of the run's own,
named after its job (`--deliver vectors:JOB`), then also writes
`var/demo/results.jsonl` (OpenAI Batch output lines, one embedding per
paragraph, read with `results --all`); searches the store for a few questions
and prints the nearest paragraphs; prints a summary; and stops the broker
cleanly. The nearest paragraphs and the summary go to stdout, progress to
stderr. Run again, it says what it found and does it all again as a new job,
into a new store (so each paragraph is one hit), rewriting the results file.
Ctrl-C stops the broker cleanly too: it drains, and a second Ctrl-C stops it at once
(assembly/private_broker.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from assembly.private_broker import start_broker, stop_broker, wait_ready, write_config
from cli.progress_line import ProgressLine, bar
from pipeline.core import exitcodes
from pipeline.core.errors import BrokerUnavailableError
from pipeline.core.invocation import how_to_run

REPO = Path(__file__).resolve().parents[1]
MIN_WORDS = 6
SENTENCE_WORDS = 60  # a paragraph is cut at the first sentence end past this many words
MAX_WORDS = 90  # ... or here at the latest
MAX_TOKENS = 256  # the model's limit; the few longer pieces (code) are left out
START_TIMEOUT_S = 120.0  # for the broker to answer: stages start slowly on a busy machine
LANES = (16, 24, 32, 48, 64, 96, 128, 192, 256)  # token lengths of its batches' lanes


def corpus() -> list[str]:
    """Paragraphs of the Python documentation topics (pydoc_data ships with CPython)."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            words = block.split()
            if len(words) < MIN_WORDS:
                continue
            piece: list[str] = []
            for word in words:
                piece.append(word)
                sentence_end = word.endswith((".", ":", ";"))
                if len(piece) >= MAX_WORDS or (len(piece) >= SENTENCE_WORDS and sentence_end):
                    paragraphs.append(" ".join(piece))
                    piece = []
            if len(piece) >= MIN_WORDS:
                paragraphs.append(" ".join(piece))
    from tokenizers import Tokenizer

    from gpu.engines.minilm import minilm_tokenizer_path

    tokenizer = Tokenizer.from_file(str(minilm_tokenizer_path()))
    tokenizer.no_truncation()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(paragraphs)]
    return [p for p, n in zip(paragraphs, lengths, strict=True) if n <= MAX_TOKENS]


def add_parser(commands) -> None:
    demo = commands.add_parser("demo", help="embed the Python docs with MiniLM, end to end")
    demo.add_argument("--dir", default="var/demo", help="where the demo keeps its broker and files")
    demo.add_argument("--workers", type=int, default=1, help="local minilm worker processes")
    demo.add_argument("--limit", type=int, help="embed only the first N paragraphs")
    demo.set_defaults(handler=demo_command)


def demo_command(args: argparse.Namespace) -> int:
    return run_demo(args.dir, args.workers, args.limit)


def demo_config(root: Path, workers: int) -> Path:
    """The demo broker's config, `root`/demo.toml: minilm, its vectors kept, metrics on."""
    from gpu.engines.minilm import minilm_tokenizer_path

    minilm = {
        "name": "minilm",
        "engine": "minilm",
        "tokenizer": str(minilm_tokenizer_path()),
        "max_tokens": MAX_TOKENS,
    }
    more: dict[str, dict] = {
        "broker": {"segment_bytes": 16 << 20, "lanes": list(LANES)},
        "ingest": {"chunk_items": 512},
        # the store holds them; `results --all` reads them meanwhile
        "completion": {"results_retention_s": 600.0},
        "workers": {"batch_items": 64, "batch_tokens": 16384, "prefetch": 2},
    }
    header = "Written by `python run.py demo`; rewritten on every run."
    return write_config(
        root / "demo.toml", header, root / "data", [minilm], workers, more, metrics=True
    )


class _Bar:
    """`submit [#####.....] 120/300 durable` on the progress line (stderr), every 5 s in a log."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.line = ProgressLine(every_s=5.0)

    def show(self, done: int, note: str = "", final: bool = False) -> None:
        line = f"{self.label:<10} {bar(done, max(1, self.total))} {done}/{self.total} {note}"
        self.line.show(line.rstrip(), final=final)


def run_demo(root: Path | str = "var/demo", workers: int = 1, limit: int | None = None) -> int:
    from collector.results_client import ResultsClient
    from collector.vectors.client import VectorsClient
    from config import load_settings
    from ingest.submit_client import Producer

    root = (REPO / root) if not Path(root).is_absolute() else Path(root)
    root.mkdir(parents=True, exist_ok=True)
    jobs_dir = root / "data" / "jobs"
    earlier = sorted(p.name for p in jobs_dir.iterdir() if p.is_dir()) if jobs_dir.is_dir() else []
    if earlier:
        print(
            f"demo: found {root} with {len(earlier)} earlier job(s) ({', '.join(earlier[-3:])}); "
            "running again as a new job, into a vector store of its own",
            file=sys.stderr,
        )
    for old in ("results.jsonl", "errors.jsonl", "corpus.jsonl", "broker.err"):
        (root / old).unlink(missing_ok=True)
    paragraphs = corpus()
    texts = paragraphs[:limit]
    with open(root / "corpus.jsonl", "w") as out:
        for i, text in enumerate(texts):
            request = {
                "custom_id": f"para-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "minilm", "input": text},
            }
            out.write(json.dumps(request) + "\n")
    config = demo_config(root, workers)
    settings = load_settings(config)
    print(
        f"demo: {len(texts)} paragraphs of the Python documentation -> all-MiniLM-L6-v2 "
        f"embeddings on the CPU ({workers} local worker(s)); broker logs in {root / 'data/log'}",
        file=sys.stderr,
    )
    broker = start_broker(config, root / "broker.err")
    started = time.monotonic()
    job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"

    def alive() -> None:
        if broker.poll() is not None:
            raise BrokerUnavailableError(
                f"the demo's broker stopped (exit {broker.returncode}); see {root / 'broker.err'}"
            )

    try:
        # patient: the broker started a moment ago and is not listening yet
        with Producer(settings.ingest.bind, timeout_s=30.0, attempts=20, patient=True) as producer:
            if not wait_ready(producer, job_id, alive, START_TIMEOUT_S):
                raise BrokerUnavailableError(
                    f"the demo's broker did not answer within {START_TIMEOUT_S:.0f} s; see "
                    f"{root / 'broker.err'}"
                )
            bar = _Bar("submit", len(texts))
            report = producer.submit_file(
                root / "corpus.jsonl",
                job_id,
                progress=lambda r, lines: bar.show(lines),
                deliver=f"vectors:{job_id}",  # a store of this run's own: each hit once
            )
            bar.show(report.stored + report.rejected, "durable", final=True)
        submitted = time.monotonic()
        bar = _Bar("embed", len(texts))
        with (
            ResultsClient(settings.completion.bind, timeout_s=10.0, patient=True) as client,
            VectorsClient(settings.vectors.bind, timeout_s=10.0, patient=True) as vectors,
        ):
            while not vectors.job_delivered(job_id):
                info = client.job_status(job_id)
                bar.show(info["completed"] + info["failed"], f"({info['state']})")
                time.sleep(0.2)  # the job is running: look again
            bar.show(len(texts), "in the vector store", final=True)
            finished = time.monotonic()
            fetched = client.fetch(  # as well as the store: every result, as JSONL
                job_id, str(root / "results.jsonl"), str(root / "errors.jsonl"), everything=True
            )
            neighbours = _search(settings, vectors, job_id, paragraphs)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # below the progress line, and the terminal's ^C
        stop_broker(broker, settings, _say, resumable=False)  # a second Ctrl-C kills it
        return exitcodes.INTERRUPTED
    except BaseException:
        stop_broker(broker, settings)
        raise
    code = stop_broker(broker, settings)
    print(neighbours)  # the answers on stdout; the progress above went to stderr
    tokens = 0
    with open(root / "results.jsonl") as results:
        for line in results:
            tokens += json.loads(line)["response"]["body"]["usage"]["prompt_tokens"]
    elapsed = finished - started
    run = how_to_run()  # the interpreter the user ran: `python` may not be on their PATH
    print(
        f"\ndemo: {fetched.written} embeddings, {fetched.errors} errors, {tokens} tokens in "
        f"{elapsed:.1f} s ({fetched.written / max(finished - submitted, 1e-9):.0f} items/s "
        f"after submit, {fetched.written / elapsed:.0f} items/s overall)\n"
        f"  vectors: store {job_id} in {root / 'data/vectors' / job_id}\n"
        f"  results: {root / 'results.jsonl'}  (errors: {root / 'errors.jsonl'})\n"
        f"  broker stopped (exit {code}); start it yourself and look around:\n"
        f"    {run} --config {config}\n"
        f"    {run} status --config {config}\n"
        f"    {run} status {job_id} --config {config}\n"
        f"    {run} vectors stats --config {config}\n"
        f'    {run} vectors search --store {job_id} --text "how do I read a file" '
        f"--config {config}\n"
        f"    {run} results {job_id} -o out.jsonl --all --config {config}"
    )
    return exitcodes.OK if code == 0 and fetched.written else exitcodes.FAILED


QUESTIONS = (
    "how do I catch an exception",
    "iterate over the keys of a dictionary",
    "what does the with statement do",
)


def _search(settings, vectors, store: str, texts: list[str]) -> str:
    """The store's 3 nearest paragraphs to a few questions, embedded by the same model.
    `texts`: the corpus, as the custom_ids (`para-<index>`) name it."""
    from collector.vectors.client import embed_texts

    queries = embed_texts(settings, "minilm", list(QUESTIONS))
    hits = vectors.search(store, queries, 3, "cosine")
    k = hits.meta["shape"][1]
    lines = [f"demo: nearest paragraphs in the vector store ({hits.meta['rows']} vectors):"]
    for i, question in enumerate(QUESTIONS):
        lines.append(f"  {question!r}")
        for j in range(k):
            custom_id = hits.meta["custom_ids"][i * k + j] or ""
            text = texts[int(custom_id.removeprefix("para-"))] if custom_id else "?"
            score = float(hits.arrays["scores"][i, j])
            lines.append(f"    {score:.3f} {custom_id}: {text[:90]}...")
    return "\n".join(lines)


def _say(line: str) -> None:
    print(f"demo: {line}", file=sys.stderr, flush=True)
