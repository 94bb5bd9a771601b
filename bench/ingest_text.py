"""Text input for the ingest benchmark: a word-level tokenizer and an OpenAI Batch JSONL file.

Nothing is downloaded: `build_tokenizer` makes a `tokenizers` WordLevel
model over a synthetic vocabulary (random lowercase words of 3-10 letters)
with a whitespace pre-tokenizer and saves its tokenizer.json;
`write_batch_file` writes embedding lines whose `input` is 20-40 words of
that vocabulary, so every word is one token and the token count of the
file is known without tokenising it here.

`bench_text` is step 4 of bench/ingest.py: that file through
`Producer.submit_file` into a broker whose model has the tokenizer, with 1
and then 2 tokeniser processes, K times each (a new job each time); and the
two halves of the work alone in this process, without a broker.

Step 4 alone (no disk, fabric or Redis steps; nothing written to the docs):

    .venv/bin/python bench/ingest_text.py [--text-lines N] [--repeat K] [--dir PATH]
                                          [--profile]

`--profile` also samples every broker stage and the producer with py-spy
during one more, untimed submit per process count (bench/ingest_profile.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ingest_profile, machine
from bench.ingest_broker import BenchBroker, Model, cpu_times, write_config
from bench.ingest_common import CHUNK_ITEMS, SEED, WINDOW, Outcome, Plan, progress
from bench.report import Row, markdown_table
from ingest.submit_client import Producer
from pipeline.core.errors import BrokerUnavailableError

REPO = Path(__file__).resolve().parent.parent
VOCAB_WORDS = 30_000
WORDS_PER_LINE = (20, 40)  # inclusive
MODEL = "texty"
STEP = "4 text"
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)


def vocabulary(rng: np.random.Generator, n: int = VOCAB_WORDS) -> list[str]:
    """n distinct random lowercase words."""
    words: set[str] = set()
    while len(words) < n:
        lengths = rng.integers(3, 11, n)
        letters = LETTERS[rng.integers(0, 26, int(lengths.sum()))].tobytes().decode()
        ends = np.cumsum(lengths)
        words.update(
            letters[e - k : e] for e, k in zip(ends.tolist(), lengths.tolist(), strict=True)
        )
    return sorted(words)[:n]


def build_tokenizer(path: Path, words: list[str]) -> Path:
    """A WordLevel tokenizer.json over `words` (id 0 is [UNK]); no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0} | {word: i + 1 for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def write_batch_file(
    path: Path, lines: int, model: str, words: list[str], rng: np.random.Generator
) -> int:
    """`lines` embedding requests of 20-40 words each; returns the total word (= token) count."""
    low, high = WORDS_PER_LINE
    counts = rng.integers(low, high + 1, lines)
    picks = rng.integers(0, len(words), int(counts.sum())).tolist()
    ends = np.cumsum(counts).tolist()
    with open(path, "wb") as out:
        start = 0
        for i, end in enumerate(ends):
            line = {
                "custom_id": f"t{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": " ".join(words[w] for w in picks[start:end])},
            }
            out.write(orjson.dumps(line) + b"\n")
            start = end
    return int(counts.sum())


PROFILE_S = 6


def bench_text(plan: Plan, outcome: Outcome, profile: bool = False) -> list[Row]:
    """Step 4: the file through `submit_file`, with 1 and 2 tokeniser processes.

    Rows: each half alone; tokenize_chunk alone on one tokeniser's share of
    the cores; end to end with 1 and 2 processes; end to end against the
    tokenisers alone (per process); the 2/1 scaling; the CPU of each process.
    """
    rng = np.random.default_rng(SEED + 4)
    root = plan.root / "text"
    root.mkdir()
    words = vocabulary(rng)
    tokenizer = build_tokenizer(root / "tokenizer.json", words)
    source = root / "requests.jsonl"
    n, n_tokens = plan.text_lines, write_batch_file(source, plan.text_lines, MODEL, words, rng)
    rows = _alone(root, tokenizer, source, n, n_tokens)
    cores = len(os.sched_getaffinity(0))
    alone: dict[int, float] = {}
    alone_cpu: dict[int, float] = {}  # CPU seconds per line
    for processes in (1, 2):
        threads = max(1, cores // processes)  # as each tokeniser process gets (share_cores)
        alone[processes], cpu_per_line = _tokenize_alone(root, tokenizer, source, threads)
        alone_cpu[processes] = cpu_per_line
        share = f"on {threads} thread(s) (one tokeniser's share with {_processes(processes)})"
        rows += [
            Row(STEP, f"alone: tokenize_chunk {share}, lines/s", (alone[processes],)),
            Row(STEP, f"alone: tokenize_chunk {share}, CPU us per line", (1e6 * cpu_per_line,)),
        ]
    end_to_end: dict[int, list[float]] = {}
    for processes in (1, 2):
        broker = BenchBroker(
            root / f"broker-{processes}", [Model(MODEL, str(tokenizer))], processes
        )
        try:
            broker.start()
            seconds, cpu = _submits(plan, broker, source, processes)
            if profile:
                outcome.profile += _profile(plan, broker, source, processes)
            code = broker.stop()
            outcome.checks.append(
                (f"step 4 broker ({_processes(processes)}) stopped: exit code {code}", code == 0)
            )
        except (BrokerUnavailableError, RuntimeError) as exc:
            crash = _crash_line(broker)
            why = f"tokenizer log: `{crash}`" if crash else str(exc)[:300]
            outcome.checks.append((f"step 4 with {_processes(processes)} failed: {why}", False))
            progress(f"step 4: {_processes(processes)} failed: {why}")
            break  # more processes would fail the same way
        finally:
            broker.close()
        label = _processes(processes)
        end_to_end[processes] = [n / s for s in seconds]
        rows += [
            Row(STEP, f"submit_file lines/s, {label}, end to end", tuple(end_to_end[processes])),
            Row(
                STEP,
                f"submit_file tokens/s, {label}, end to end",
                tuple(n_tokens / s for s in seconds),
            ),
            Row(
                STEP,
                f"end to end / tokenize_chunk alone, per tokeniser process ({label})",
                tuple(r / (processes * alone[processes]) for r in end_to_end[processes]),
                percent=True,
                target=">= 90%",
                at_least=0.9,
            ),
            *[
                Row(STEP, f"CPU us per line: {who} ({label})", tuple(1e6 * x for x in v))
                for who, v in cpu.items()
            ],
            Row(
                STEP,
                f"CPU us per line: all processes ({label}); {cores} cores / this = the bound",
                tuple(1e6 * sum(v) for v in zip(*cpu.values(), strict=True)),
            ),
            Row(
                STEP,
                f"tokenize_chunk alone's CPU per line / all processes' ({label}): end to end "
                "/ alone when the cores bound both, whatever else runs",
                tuple(alone_cpu[processes] / sum(v) for v in zip(*cpu.values(), strict=True)),
                percent=True,
            ),
        ]
    if len(end_to_end) == 2:
        pairs = zip(end_to_end[2], end_to_end[1], strict=True)  # paired by repeat
        rows.append(
            Row(
                STEP,
                "scaling: end to end with 2 tokeniser processes / with 1",
                tuple(two / one for two, one in pairs),
                target=f">= 1.8 while cores are free ({cores} here)",
                at_least=1.8 if cores >= 4 else None,
            )
        )
    outcome.notes.append(
        f"Step 4: {n:,} lines of {WORDS_PER_LINE[0]}-{WORDS_PER_LINE[1]} words "
        f"({n_tokens / n:.1f} tokens per line on average) from a WordLevel vocabulary of "
        f"{len(words):,} random words (one token per word, whitespace pre-tokenizer, built "
        "here with the tokenizers library; nothing downloaded). The tokenizers library "
        "encodes on its own thread pool; each tokeniser process sizes it to its share of "
        "the cores (RAYON_NUM_THREADS = cores / processes, ingest/tokenize.py share_cores). "
        "'Alone' rows run one half of the work without a broker: the SDK's parse and check "
        "of the whole file, then tokenize_chunk on its chunks (in this process, on the "
        "library's default pool; and in a fresh process per thread count, as a tokeniser "
        "process with 1 or 2 siblings would run it). 'Per tokeniser process' divides the end "
        "to end rate by the processes times tokenize_chunk alone on one process's share; "
        "the CPU rows (user + system seconds from /proc/<pid>/stat over each submit, per line) "
        "say what shares the cores (the producer runs in this process): no rate end to end "
        "can pass the cores divided by the CPU per line of all processes together."
    )
    return rows


def _submits(
    plan: Plan, broker: BenchBroker, source: Path, processes: int
) -> tuple[list[float], dict[str, list[float]]]:
    """Time K submits of the file; return their seconds and each process's CPU seconds per
    line (those under 2% of a core left out)."""
    watched = {**broker.pids(), "producer (bench)": os.getpid()}
    seconds, cpu = [], {label: [] for label in watched}
    with Producer(broker.address, window=WINDOW, timeout_s=10, attempts=2) as sdk:
        for k in range(plan.repeat):
            before = {label: sum(cpu_times(pid)) for label, pid in watched.items()}
            started = time.perf_counter()
            report = sdk.submit_file(source, f"text-{os.getpid()}-{processes}-{k}")
            seconds.append(time.perf_counter() - started)
            for label, pid in watched.items():
                cpu[label].append((sum(cpu_times(pid)) - before[label]) / plan.text_lines)
            if report.stored != plan.text_lines:
                raise RuntimeError(
                    f"stored {report.stored:,} of {plan.text_lines:,} lines: {report.errors[:3]}"
                )
            progress(
                f"step 4: {_processes(processes)}, run {k + 1}: "
                f"{plan.text_lines / seconds[-1]:,.0f} lines/s"
            )
    lines = plan.text_lines
    busy = {
        label: v
        for label, v in cpu.items()
        if any(x * lines >= 0.02 * t for x, t in zip(v, seconds, strict=True))
    }
    return seconds, busy


def _profile(plan: Plan, broker: BenchBroker, source: Path, processes: int) -> list[str]:
    """py-spy on every stage and the producer during more (untimed) submits of the file."""
    binary = ingest_profile.py_spy()
    if binary is None:
        return ["Profile skipped: py-spy is not installed."]
    pids = {**broker.pids(), "producer (bench)": os.getpid()}
    done = {"submits": 0, "seconds": 0.0}
    with Producer(broker.address, window=WINDOW, timeout_s=10, attempts=2) as sdk:

        def keep_busy() -> None:
            started = time.perf_counter()
            sdk.submit_file(source, f"profile-{os.getpid()}-{processes}-{done['submits']}")
            done["submits"] += 1
            done["seconds"] += time.perf_counter() - started

        progress(f"step 4: profiling {', '.join(pids)} for {PROFILE_S} s")
        out = plan.root / f"profile-text-{processes}"
        profiles = ingest_profile.profile(binary, pids, PROFILE_S, out, keep_busy)
    rate = done["submits"] * plan.text_lines / max(done["seconds"], 1e-9)
    return [f"**Step 4 with {_processes(processes)}**", "", *ingest_profile.render(profiles, rate)]


def _processes(n: int) -> str:
    return "1 tokeniser process" if n == 1 else f"{n} tokeniser processes"


def _crash_line(broker: BenchBroker) -> str:
    """The exception line of the first traceback in a tokenizer's log, if there is one."""
    for path in sorted(broker.log_dir.glob("tokenizer-*.log")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                rest = [x for x in lines[i + 1 :] if x and not x.startswith((" ", "Traceback"))]
                return rest[0] if rest else line
    return ""


ALONE = """
import sys, time
from bench.ingest_common import CHUNK_ITEMS
from config import load_settings
from ingest.batch_input import iter_batch_input
from ingest.tokenize import load_tokenizers, tokenize_chunk
settings = load_settings(sys.argv[1])
tokenizers = load_tokenizers(settings)
chunks = list(iter_batch_input(sys.argv[2], settings, chunk_lines=CHUNK_ITEMS))
started, cpu = time.perf_counter(), time.process_time()
lines = sum(tokenize_chunk(chunk, tokenizers, settings).n_items for chunk in chunks)
print(lines / (time.perf_counter() - started), (time.process_time() - cpu) / lines)
"""


def _tokenize_alone(root: Path, tokenizer: Path, source: Path, threads: int) -> tuple[float, float]:
    """tokenize_chunk over the file in a fresh process with a pool of `threads`: its lines/s
    and its CPU seconds per line (every thread of the process)."""
    home = root / f"alone-{threads}"
    home.mkdir(exist_ok=True)
    config = write_config(home, [Model(MODEL, str(tokenizer))])
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", ALONE, str(config), str(source)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    rate, cpu = done.stdout.split()[-2:]
    return float(rate), float(cpu)


def _alone(root: Path, tokenizer: Path, source: Path, n: int, n_tokens: int) -> list[Row]:
    """The producer's parse-and-check and the tokeniser's encoding, each alone in this process."""
    from config import load_settings
    from ingest.batch_input import iter_batch_input
    from ingest.tokenize import load_tokenizers, tokenize_chunk

    settings = load_settings(write_config(root, [Model(MODEL, str(tokenizer))]))
    tokenizers = load_tokenizers(settings)
    started = time.perf_counter()
    chunks = list(iter_batch_input(source, settings, chunk_lines=CHUNK_ITEMS))
    parse_s = time.perf_counter() - started
    started = time.perf_counter()
    tokens = sum(len(tokenize_chunk(chunk, tokenizers, settings).tokens) for chunk in chunks)
    tokenize_s = time.perf_counter() - started
    if tokens != n_tokens:
        raise RuntimeError(f"tokenised {tokens:,} tokens, expected {n_tokens:,}")
    return [
        Row(STEP, "alone: SDK parse + check (iter_batch_input), lines/s", (n / parse_s,)),
        Row(STEP, "alone: tokenize_chunk, lines/s", (n / tokenize_s,)),
        Row(STEP, "alone: tokenize_chunk, tokens/s", (n_tokens / tokenize_s,)),
    ]


def main(argv: list[str] | None = None) -> int:
    """Step 4 alone: print its table (and profiles with --profile); the docs are not touched."""
    parser = argparse.ArgumentParser(description="bench/ingest.py step 4 (text) alone")
    parser.add_argument("--text-lines", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO / "var" / "bench-ingest")
    parser.add_argument("--profile", action="store_true", help="py-spy every process")
    args = parser.parse_args(argv)
    if args.text_lines < 1 or args.repeat < 1:
        parser.error("need --text-lines >= 1 and --repeat >= 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    root = args.dir / f"text-{os.getpid()}"
    root.mkdir()
    outcome = Outcome()
    try:
        rows = bench_text(
            Plan(root, CHUNK_ITEMS, args.repeat, args.text_lines, "off"), outcome, args.profile
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(markdown_table(rows))
    print()
    for label, ok in outcome.checks:
        print(f"- [{'x' if ok else ' '}] {label}")
    print(f"- load average at end: {machine.load_average()}")
    for line in [*outcome.notes, "", *outcome.profile]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
