"""Usage of fan-out lines: a prompt counts once however many samples `n` it asks for.

OpenAI counts a request's prompt once in `usage.prompt_tokens` whatever its
`n`; a list of different prompts counts each of them. The body's usage
(collector/delivery/join.py over collector/completion/line_pages.py) and the
job's token totals (`status JOB`, collector/completion/job_results.py) both
follow it, also after the completion stage rebuilds them from its segments.
docs/completion.md, "Lines and parts".
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import openai.types
import test_fanout
from broker import Broker
from conftest import assert_check_clean
from test_dispatch_pipeline import assert_each_once, job_info
from test_fanout import line, outputs, run_job, write
from test_oneshot import RUN_BOUND_S, batch

from pipeline.core import exitcodes
from pipeline.core.item_seq import PART_BASE
from pipeline.core.line_table import LineTable
from pipeline.store.datadir import DataDir

broker = test_fanout.broker  # the fixture: a broker with the echo model `gen`


def test_a_line_table_entry_without_n_repeats_no_prompt_and_with_n_repeats_samples_1_on():
    base = PART_BASE
    old = LineTable()
    old.add([[1, 4, base]])  # a journal written before `n` was recorded: 4 prompts
    assert not old.repeats(np.array([0, base, base + 1, base + 2])).any()
    table = LineTable()
    table.add([[1, 4, base, 2], [2, 3, base + 3]])  # 2 prompts x n = 2; then 3 prompts
    # line 1: part 0 (index 0), parts 1..3 (base..base+2); part p repeats when p % 2 == 1
    got = table.repeats(np.array([0, base, base + 1, base + 2, 1, base + 3, base + 4]))
    assert got.tolist() == [False, True, False, True, False, False, False]


def test_usage_counts_each_prompt_once_for_n_samples_in_bodies_and_job_totals(tmp_path, broker):
    b = broker(workers=1)
    chat = {"messages": [{"role": "user", "content": "f g h"}], "max_tokens": 8}
    lines = [
        # echo: a completion repeats its prompt's token ids, cut to max_tokens
        line("ids-n", "/v1/completions", model="gen", prompt=[[1, 2, 3], [4]], n=3, max_tokens=8),
        line(
            "one-n",
            "/v1/completions",
            model="gen",
            prompt_token_ids=[5, 6, 7, 8, 9],
            n=4,
            max_tokens=2,
        ),
        line("chat-n", "/v1/chat/completions", model="gen", n=4, **chat),
        line("chat-1", "/v1/chat/completions", model="gen", **chat),
        line("list", "/v1/embeddings", model="gen", input=[[1, 2], [3, 4, 5]]),
    ]
    out = run_job(b, tmp_path, "usage", lines)
    got = outputs(out)
    assert set(got) == {x["custom_id"] for x in lines}

    def usage(custom_id: str, kind):
        return kind.model_validate(got[custom_id]["response"]["body"]).usage

    ids_n = usage("ids-n", openai.types.Completion)
    assert (ids_n.prompt_tokens, ids_n.completion_tokens) == (3 + 1, 3 * 3 + 3 * 1)
    assert ids_n.total_tokens == 4 + 12
    one_n = usage("one-n", openai.types.Completion)
    assert (one_n.prompt_tokens, one_n.completion_tokens, one_n.total_tokens) == (5, 4 * 2, 13)
    chat_n = usage("chat-n", openai.types.chat.ChatCompletion)
    chat_1 = usage("chat-1", openai.types.chat.ChatCompletion)
    assert chat_n.prompt_tokens == chat_1.prompt_tokens > 0
    assert chat_n.completion_tokens == 4 * chat_1.completion_tokens
    listed = usage("list", openai.types.CreateEmbeddingResponse)
    assert listed.prompt_tokens == listed.total_tokens == 2 + 3  # different prompts: each

    bodies = [got[x["custom_id"]]["response"]["body"]["usage"] for x in lines]
    want = {
        "prompt_tokens": sum(u["prompt_tokens"] for u in bodies),
        "completion_tokens": sum(u.get("completion_tokens", 0) for u in bodies),
    }
    want["total_tokens"] = want["prompt_tokens"] + want["completion_tokens"]
    assert job_info(b, "usage")["usage"] == want
    assert b.stop() == 0, b.stderr
    again = Broker(b.config).start()  # completion rebuilds the totals from its segments
    try:
        assert job_info(again, "usage")["usage"] == want
    finally:
        assert again.stop() == 0, again.stderr
    assert_check_clean(b.data_dir)


# A /v1/responses line (its usage holds objects: input_tokens_details, output_tokens_details)
# in a job with fan-out lines: every row of such a job's pages is joined, one-part lines too.
MIXED = [
    line("resp", "/v1/responses", model="gen", input="w1 w2 w3", max_output_tokens=8),
    line("prompts", "/v1/completions", model="gen", prompt=["w1 w2", "w3"], max_tokens=8),
    line(
        "chat-n",
        "/v1/chat/completions",
        model="gen",
        messages=[{"role": "user", "content": "w4 w5"}],
        n=2,
        max_tokens=8,
    ),
]


def _assert_mixed_delivered(out: Path) -> None:
    """Each MIXED line once, as an output line in the openai package's types, usage summed."""
    assert_each_once(out, len(MIXED))
    got = outputs(out)
    assert set(got) == {x["custom_id"] for x in MIXED}

    def body(custom_id: str) -> dict:
        return got[custom_id]["response"]["body"]

    resp = openai.types.responses.Response.model_validate(body("resp")).usage
    assert resp.input_tokens > 3  # the input, in the model's chat template
    assert resp.output_tokens == len(body("resp")["token_ids"]) == 8  # echo, cut at the most
    assert resp.total_tokens == resp.input_tokens + resp.output_tokens
    assert resp.input_tokens_details.cached_tokens == 0
    assert resp.output_tokens_details.reasoning_tokens == 0
    prompts = openai.types.Completion.model_validate(body("prompts"))
    assert [c.text for c in prompts.choices] == ["w1 w2", "w3"]
    usage = prompts.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 3, 6)
    chat = openai.types.chat.ChatCompletion.model_validate(body("chat-n"))
    generated = [len(c.model_extra["token_ids"]) for c in chat.choices]
    assert len(generated) == 2 and generated[0] == generated[1] > 0
    assert chat.usage.completion_tokens == sum(generated)  # the prompt counts once
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_a_responses_line_beside_fan_out_lines_is_delivered_by_results_and_batch(tmp_path, broker):
    b = broker(workers=1)
    _assert_mixed_delivered(run_job(b, tmp_path, "mixed", MIXED))
    assert b.stop() == 0, b.stderr
    assert_check_clean(b.data_dir)
    # `run.py batch`: its own broker, the same file
    source, out = write(tmp_path / "batch.jsonl", MIXED), tmp_path / "batch" / "out.jsonl"
    out.parent.mkdir()
    tokenizer = str(tmp_path / "tokenizer.json")  # the broker's config wrote it
    args = ("--model", "gen", "--engine", "echo", "--tokenizer", tokenizer)
    log = tmp_path / "batch.err"
    proc = batch(str(source), "-o", str(out), *args, log=log)
    try:
        assert proc.wait(timeout=RUN_BOUND_S) == exitcodes.OK, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_mixed_delivered(out)
    assert_check_clean(DataDir(out.parent / "out.jsonl.fabric" / "data"))
