"""The client's join of fan-out pages costs about what the same rows one per line cost.

A page of fan-out lines (docs/completion.md, "Lines and parts") is rendered
once: `page_keys` names its lines without rendering a row, and the join
takes the rendered rows as dicts, never parsing JSON back
(collector/delivery/lines.py, join.py; bench/engine_overhead.py --lists).
"""

from __future__ import annotations

import json

import numpy as np
import openai.types
import orjson

from collector.delivery import join, line_bodies, lines
from collector.delivery.join import join_lines
from collector.delivery.lines import format_page, page_keys
from collector.delivery.result_page import ExportContext, ResultPage
from pipeline.core.result_kinds import ResultKind, ResultStatus


def fanned_page(rows: int = 12, per_line: int = 4, dim: int = 3, failed_row: int = 5):
    """`rows` embeddings rows, `per_line` parts a line; row `failed_row` an error result."""
    vectors = np.arange(rows * dim, dtype="<f4").reshape(rows, dim)
    payloads = [v.tobytes() for v in vectors]
    status = np.full(rows, ResultStatus.RESULT, np.uint8)
    kind = np.full(rows, ResultKind.VECTOR, np.uint8)
    payloads[failed_row] = b"engine_error: it broke"
    status[failed_row], kind[failed_row] = ResultStatus.ERROR, ResultKind.TEXT
    offsets = np.r_[0, np.cumsum([len(p) for p in payloads])].astype(np.int64)
    line = np.arange(rows) // per_line
    return ResultPage(
        index=line.astype(np.uint32),
        custom_ids=[f"c{i}" for i in line.tolist()],
        status=status,
        kind=kind,
        shape=np.ones(rows, np.uint16),
        prompt_tokens=np.full(rows, 2, np.uint32),
        payload=np.frombuffer(b"".join(payloads), np.uint8),
        offsets=offsets,
        part=(np.arange(rows) % per_line).astype(np.uint32),
    )


def test_a_fan_out_page_is_rendered_once_and_never_parsed_back(monkeypatch):
    page = fanned_page()
    context = ExportContext("job", "m", {1: {"endpoint": "/v1/embeddings"}})

    def no(*args, **kwargs):
        raise AssertionError("rendered or parsed again")

    monkeypatch.setattr(join.orjson, "loads", no)
    out, err = format_page(page, context)
    monkeypatch.setattr(lines, "format_lines_one_by_one", no)
    out_keys, err_keys = page_keys(page, context)
    assert out_keys == ["custom_id:c0", "custom_id:c2"] and err_keys == ["custom_id:c1"]
    monkeypatch.undo()
    assert [json.loads(x)["custom_id"] for x in out] == ["c0", "c2"]
    body = openai.types.CreateEmbeddingResponse.model_validate(
        orjson.loads(out[1])["response"]["body"]
    )
    assert [d.index for d in body.data] == [0, 1, 2, 3]
    assert [d.embedding for d in body.data] == [
        [24.0, 25.0, 26.0],
        [27.0, 28.0, 29.0],
        [30.0, 31.0, 32.0],
        [33.0, 34.0, 35.0],
    ]
    assert body.usage.prompt_tokens == 8
    [error] = [json.loads(x) for x in err]
    assert error["custom_id"] == "c1" and error["error"]["message"].startswith("part 1 of 4: ")


def _completion_row(part: int, cached: int, reasoning: int) -> dict:
    """A rendered /v1/completions row whose usage carries OpenAI's nested details."""
    usage = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning, "audio_tokens": 0},
    }
    choice = {"index": 0, "text": f"t{part}", "logprobs": None, "finish_reason": "stop"}
    body = {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "usage": usage,
    }
    response = {"status_code": 200, "request_id": "r", "body": body}
    return {"id": "batch_req_x", "custom_id": "c", "response": response, "error": None}


def test_usage_is_joined_field_by_field_nested_details_too():
    """Issue 30 point 2: nested usage objects were added to an int (TypeError), which took the
    whole page down on every fetch; they are summed field by field."""
    rows = [_completion_row(p, cached=p + 1, reasoning=2 * p) for p in range(3)]
    [(first, line)], err = join_lines(
        np.zeros(3),
        np.array([2, 0, 1]),
        [(0, True, rows[2]), (1, True, rows[0]), (2, True, rows[1])],
    )
    assert (first, err) == (1, [])
    body = openai.types.Completion.model_validate(orjson.loads(line)["response"]["body"])
    assert [c.text for c in body.choices] == ["t0", "t1", "t2"]
    usage = body.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (9, 6, 15)
    assert usage.prompt_tokens_details.cached_tokens == 1 + 2 + 3
    assert usage.completion_tokens_details.reasoning_tokens == 0 + 2 + 4
    assert usage.completion_tokens_details.audio_tokens == 0


def test_a_line_the_client_cannot_render_or_join_is_its_own_error_line(monkeypatch):
    """Issue 30 point 2: a row whose rendering raises makes its line an `invalid_result` error
    line (`part P of K: ...`), and so does a line whose rows cannot be joined; the page's other
    lines are delivered."""
    page = fanned_page(failed_row=11)  # lines c0 (rows 0-3), c1 (4-7), c2 (8-11, 11 failed)
    context = ExportContext("job", "m", {1: {"endpoint": "/v1/embeddings"}})
    embedding_body = line_bodies.embedding_body

    def body_of(embedding, *args):
        if embedding[0] == 3.0:  # row 1's vector (3, 4, 5)
            raise ValueError("cannot render (3, 4, 5)")
        return embedding_body(embedding, *args)

    monkeypatch.setattr(line_bodies, "embedding_body", body_of)
    out, err = format_page(page, context)
    assert [json.loads(x)["custom_id"] for x in out] == ["c1"]
    assert len(json.loads(out[0])["response"]["body"]["data"]) == 4
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, err)}
    assert set(errors) == {"c0", "c2"}
    assert errors["c0"]["code"] == "invalid_result"
    assert errors["c0"]["message"].startswith("part 1 of 4: ")
    assert "ValueError: cannot render (3, 4, 5)" in errors["c0"]["message"]
    assert errors["c2"]["code"] == "engine_error"
    # a line whose rows cannot be joined (here a row without its `data`) is its own error line
    rows = [(r, True, _completion_row(r, 0, 0)) for r in range(2)]
    del rows[1][2]["response"]["body"]["choices"]
    joined, failed = join_lines(
        np.array([0, 0, 1]), np.array([0, 1, 0]), [*rows, (2, True, _completion_row(0, 0, 0))]
    )
    assert [row for row, _ in joined] == [2]
    [(row, (code, message))] = failed
    assert (row, code) == (0, "invalid_result")
    assert "could not join its 2 part(s) (KeyError" in message


def test_completion_reads_past_the_parts_of_lines_not_done_yet(data_dir):
    """Rows of a fan-out line not done yet stay LIVE and unread: they neither fill a page's
    limit (an earlier line waiting for its last part held back every later line) nor get read
    and checksummed again on every page (collector/completion/line_pages.py `ready_rows`)."""
    from collector.completion.results_log import CompletionLog
    from pipeline.core.item_seq import PART_BASE
    from pipeline.core.line_table import LineTable

    table = LineTable()
    table.add([[1, 3, PART_BASE], [2, 3, PART_BASE + 2]])
    log = CompletionLog(data_dir, lambda s: None, line_table=lambda job: table)
    stored = [0, PART_BASE, 1, PART_BASE + 2, PART_BASE + 3]  # line 1 lacks its part 2
    log.record_errors("j", 1, np.array(stored), [f"e: part {i}" for i in stored])
    log.sync_outputs()
    page = log.page("j", 2)
    assert page.index.tolist() == [1, 1, 1] and sorted(page.part.tolist()) == [0, 1, 2]
    log.delivered("j", page.where)
    assert len(log.page("j", 100)) == 0 and log.undelivered("j") == 2  # line 1's, waiting
