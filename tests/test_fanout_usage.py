"""Usage of fan-out lines: a prompt counts once however many samples `n` it asks for.

OpenAI counts a request's prompt once in `usage.prompt_tokens` whatever its
`n`; a list of different prompts counts each of them. The body's usage
(collector/delivery/join.py over collector/completion/line_pages.py) and the
job's token totals (`status JOB`, collector/completion/job_results.py) both
follow it, also after the completion stage rebuilds them from its segments.
docs/completion.md, "Lines and parts".
"""

from __future__ import annotations

import numpy as np
import openai.types
import test_fanout
from broker import Broker
from conftest import assert_check_clean
from test_dispatch_pipeline import job_info
from test_fanout import line, outputs, run_job

from pipeline.item_seq import PART_BASE
from pipeline.line_table import LineTable

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
