"""Result pages -> OpenAI Batch output lines.

The broker sends a results client pages of stored results (`ResultPage`, a
few numpy columns and every item's payload back to back). `render_page`
renders one page into output lines and error lines (each one JSON object and
a newline; one buffer of each, in page order) and the key of each line (its
custom_id, or its id when the input line had no readable custom_id). The
client writes them through `ResultFile` (collector/delivery/result_file.py),
which holds each key at most once. Completions, chat and embedding lines are
built a whole page at once from templates (collector/delivery/line_templates.py);
/v1/responses and logprobs lines, and the rows of fan-out lines, one by one
(collector/delivery/line_bodies.py `format_lines_one_by_one`: a dict per line, to orjson). Both give the same
bytes (tests/test_results_templates.py). `format_page` and `page_keys` give
the same as lists, a bytes object per line.

A stored result that cannot be rendered (a status other than 0 or 1, a kind
or payload size its shape does not allow, a shape the table lacks, NaN or
infinite values) becomes an `invalid_result` error line for its item, and
the rest of its page is written; only a page whose columns disagree raises
PageError. Completion refuses such results before it stores them
(collector/completion/result_check.py); this covers data stored before it did.
So does a line this client fails to render (whatever its renderer raises: when
a page fails, each of its lines is rendered alone, and the ones that fail
become `invalid_result` error lines naming the exception), and a fan-out line
it fails to join (collector/delivery/join.py): no line takes its page down.

Payload, by `kind` and `status` (pipeline/core/result_kinds.py):

| kind       | status   | payload                               | rendered as                               |
|------------|----------|---------------------------------------|-------------------------------------------|
| 0 `TOKENS` | 0 RESULT | generated token ids, little-endian u4 | a chat.completion or text_completion line |
| 1 `VECTOR` | 0 RESULT | embedding, little-endian f4           | an embedding line (shortest f32 decimals) |
| 2 `TEXT`   | 1 ERROR  | UTF-8 `code: message`, or a message   | an error line; code `item_failed` unless the text starts with a bare identifier and ": " |
| 3 `TOKEN_LOGPROBS` | 0 RESULT | tokens with log probabilities (pipeline/core/token_logprobs.py) | a chat.completion or text_completion line whose choice has `logprobs` (collector/delivery/logprobs.py) |

Line forms (`id` and `request_id` depend only on (job_id, index), so a
re-fetch writes identical bytes: collector/delivery/line_ids.py; error lines are rendered by
`LineError.to_batch_error`, the same form ingest uses for bad input lines):

| file | form |
|------|------|
| OUT  | `{"id": "batch_req_<32 hex>", "custom_id": C, "response": {"status_code": 200, "request_id": "<32 hex>", "body": BODY}, "error": null}` |
| ERR  | `{"id": "<job_id>-line-<index + 1>", "custom_id": C, "response": null, "error": {"code": CODE, "message": MESSAGE}}` |

| endpoint               | BODY |
|------------------------|------|
| `/v1/embeddings`       | `{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [f, ...]}], "model": M, "usage": {"prompt_tokens": P, "total_tokens": P}}` |
| `/v1/chat/completions` | `{"id": "chatcmpl-<request_id>", "object": "chat.completion", "created": T, "model": M, "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT}, "logprobs": null, "finish_reason": F, "token_ids": [t, ...]}], "usage": U}` |
| `/v1/completions`      | `{"id": "cmpl-<request_id>", "object": "text_completion", "created": T, "model": M, "choices": [{"index": 0, "text": TEXT, "logprobs": null, "finish_reason": F, "token_ids": [t, ...]}], "usage": U}` |
| `/v1/responses`        | OpenAI's Response object (collector/delivery/responses.py), `usage` with input/output/total tokens |

An embedding whose shape has `encoding_format: "base64"` is written as one
string instead of the list: base64 of its little-endian float32 values,
what OpenAI sends and the openai package decodes.

A choice's `logprobs` is null unless the shape asked for them (`top_logprobs`,
result kind 3): then OpenAI's logprobs object (collector/delivery/logprobs.py).
U is `{"prompt_tokens": P, "completion_tokens": K, "total_tokens": P + K}`
with K the number of generated tokens; F is "length" when K reaches the
shape's `max_tokens`, else "stop"; T is the job's creation time in seconds;
TEXT is `decode(token_ids)`, or "" without a tokenizer (`token_ids` is always
there, as vLLM gives it, so nothing is lost).

A page with a `part` column holds fan-out lines whole (docs/completion.md,
"Lines and parts"): its rows are rendered as above, then joined into one
line per line by collector/delivery/join.py.

A line's key (`line_key`) is `custom_id:<custom_id>`, or `id:<id>` when its
custom_id is null; the prefixes keep a custom_id that looks like an id from
ever being taken for one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from collector.delivery import line_ids, line_templates
from collector.delivery.join import join_lines
from collector.delivery.line_bodies import format_lines_one_by_one
from collector.delivery.result_page import (
    Checked,
    ExportContext,
    PageError,
    ResultPage,
    check_page,
    result_words,
)
from ingest.line_errors import LineError
from pipeline.core.item_error_codes import ItemErrorCode

_BARE_CODE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DUMPS_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY
_CUSTOM_ID_KEY = "custom_id:"
_NONE = (np.zeros(0, dtype=np.int64), dict[int, str]())  # a Checked's errors and invalid, when none


@dataclass(frozen=True)
class RenderedPage:
    """A page rendered: its output lines and its error lines, each as one buffer of whole
    lines in page order, and each line's key (`line_key`) in the same order. When every
    output line has a custom_id, `out_custom_ids` holds them (the keys are made only if
    asked for: `ResultFile.write_custom_ids` takes the custom_ids as they are)."""

    out: bytes
    keys_of_out: list[str] | None  # None: "custom_id:" + each of out_custom_ids
    err: bytes
    err_keys: list[str]
    out_custom_ids: list[str] | None = None

    @property
    def out_keys(self) -> list[str]:
        if self.keys_of_out is not None:
            return self.keys_of_out
        return list(map(_CUSTOM_ID_KEY.__add__, self.out_custom_ids or []))


def render_page(page: ResultPage, context: ExportContext) -> RenderedPage:
    """Render `page`; raise PageError if its columns disagree. A stored result that cannot
    be rendered becomes an error line. The common forms are rendered a whole page at once
    (collector/delivery/line_templates.py); the rest one line at a time."""
    if page.part is not None:
        out_lines, err_lines, out_keys, err_keys = _joined_page(page, context)
        return RenderedPage(b"".join(out_lines), out_keys, b"".join(err_lines), err_keys)
    checked = check_page(page, context)
    try:
        out, out_keys, out_custom_ids = _render_results(page, context, checked)
    except Exception:  # some line this client cannot render: that line's error, not the page's
        checked = _without_unrenderable(page, context, checked)
        out, out_keys, out_custom_ids = _render_results(page, context, checked, templates=False)
    err_lines, err_keys = _error_lines(page, context, checked)
    return RenderedPage(out, out_keys, b"".join(err_lines), err_keys, out_custom_ids)


def format_page(page: ResultPage, context: ExportContext) -> tuple[list[bytes], list[bytes]]:
    """`render_page` as (output lines, error lines), one bytes object per line."""
    rendered = render_page(page, context)
    return split_lines(rendered.out), split_lines(rendered.err)


def page_keys(page: ResultPage, context: ExportContext) -> tuple[list[str], list[str]]:
    """The keys of `format_page`'s (output lines, error lines), in the same order (of a fan-out
    page, named without rendering it: a line this client then fails to render is named OUT)."""
    if page.part is not None:
        return _joined_keys(page, context, check_page(page, context))
    rendered = render_page(page, context)
    return rendered.out_keys, rendered.err_keys


def split_lines(data: bytes) -> list[bytes]:
    """Whole lines of a buffer, each with its newline (JSON lines hold no raw newline)."""
    return [line + b"\n" for line in data.split(b"\n")[:-1]]


def _error_lines(page: ResultPage, context: ExportContext, checked: Checked):
    """(error lines, their keys): stored errors, then results that cannot be rendered."""
    job_id, custom_ids, index = context.job_id, page.custom_ids, page.index.tolist()
    lines, keys = [], []
    offsets = page.offsets.tolist()
    payload = memoryview(np.ascontiguousarray(page.payload, dtype=np.uint8))
    failed = [
        (i, *_split_error(bytes(payload[offsets[i] : offsets[i + 1]])))
        for i in checked.errors.tolist()
    ]
    for i, what in checked.invalid.items():
        message = f"the stored result {what}; it cannot be delivered (report it with the job id)"
        failed.append((i, ItemErrorCode.INVALID_RESULT, message))
    for i, code, message in failed:
        error = LineError(index[i] + 1, custom_ids[i], code, message)
        lines.append(error.to_batch_error_line(job_id))
        keys.append(line_key(custom_ids[i], f"{job_id}-line-{index[i] + 1}"))
    return lines, keys


def _joined_page(page: ResultPage, context: ExportContext):
    """(output lines, error lines, their keys) of a page of fan-out lines: each row rendered
    alone, then the rows of each line joined (collector/delivery/join.py)."""
    checked = check_page(page, context)
    if len(page.part) != len(page.index):
        raise PageError(
            f"job {context.job_id}: result page column part has {len(page.part)} entries for "
            f"{len(page.index)} items; the broker sent a malformed page, report it with the job id"
        )
    try:
        lines = format_lines_one_by_one(page, context, checked, as_dicts=True)
    except Exception:  # some row this client cannot render: its line's error, not the page's
        checked = _without_unrenderable(page, context, checked)
        lines = format_lines_one_by_one(page, context, checked, as_dicts=True)
    rendered: list[tuple[int, bool, Any]] = list(
        zip(checked.results.tolist(), [True] * len(lines), lines, strict=True)
    )
    offsets = page.offsets.tolist()
    payload = memoryview(np.ascontiguousarray(page.payload, dtype=np.uint8))
    for i in checked.errors.tolist():
        rendered.append((i, False, _split_error(bytes(payload[offsets[i] : offsets[i + 1]]))))
    for i, what in checked.invalid.items():
        message = f"the stored result {what}; it cannot be delivered (report it with the job id)"
        rendered.append((i, False, (ItemErrorCode.INVALID_RESULT, message)))
    out, err = join_lines(page.index, page.part, rendered)
    job_id, custom_ids, index = context.job_id, page.custom_ids, page.index.tolist()
    ids = line_ids.request_ids(job_id, page.index)[0] if len(index) else []
    out_keys = [line_key(custom_ids[r], "batch_req_" + ids[r]) for r, _ in out]
    err_lines, err_keys = [], []
    for r, (code, message) in err:
        error = LineError(index[r] + 1, custom_ids[r], code, message)
        err_lines.append(error.to_batch_error_line(job_id))
        err_keys.append(line_key(custom_ids[r], f"{job_id}-line-{index[r] + 1}"))
    return [line for _, line in out], err_lines, out_keys, err_keys


def _without_unrenderable(page: ResultPage, context: ExportContext, checked: Checked) -> Checked:
    """`checked` less the results this client fails to render, each tried alone (one by one:
    the templates' bytes); each goes to `invalid`, to become its line's `invalid_result` error
    line. Only after a page failed to render: a fault in one line never takes down its page."""
    keep, invalid = [], dict(checked.invalid)
    for j, i in enumerate(checked.results.tolist()):
        one = Checked(checked.results[j : j + 1], checked.endpoints[j : j + 1], *_NONE)
        try:
            format_lines_one_by_one(page, context, one)
            keep.append(j)
        except Exception as exc:  # whatever this client's rendering raises on it
            invalid[i] = f"could not be rendered by this client ({type(exc).__name__}: {exc})"
    kept = np.asarray(keep, dtype=np.int64)
    endpoints = [checked.endpoints[j] for j in keep]
    return Checked(checked.results[kept], endpoints, checked.errors, invalid, checked.by_shape)


def _joined_keys(page: ResultPage, context: ExportContext, checked: Checked):
    """`_joined_page`'s (output keys, error keys) without rendering a row: a line is an error
    line when any of its rows is an error or invalid result; both in page order of lines."""
    failed = set(checked.errors.tolist()) | set(checked.invalid)
    first: dict[int, int] = {}  # line index -> its first row in the page
    bad: set[int] = set()
    for row, line in enumerate(page.index.tolist()):
        first.setdefault(line, row)
        if row in failed:
            bad.add(line)
    job_id, custom_ids = context.job_id, page.custom_ids
    ids = line_ids.request_ids(job_id, page.index)[0] if len(page.index) else []
    out_keys = [
        line_key(custom_ids[r], "batch_req_" + ids[r]) for n, r in first.items() if n not in bad
    ]
    err_keys = [
        line_key(custom_ids[r], f"{job_id}-line-{n + 1}") for n, r in first.items() if n in bad
    ]
    return out_keys, err_keys


def error_line(
    job_id: str, index: int, custom_id: str | None, payload: bytes, code: str | None = None
) -> tuple[bytes, str]:
    """One error line and its key for item `index`: `payload` is a stored error ("code: message"),
    or the message itself when `code` is given."""
    if code is None:
        code, message = _split_error(payload)
    else:
        message = payload.decode("utf-8", errors="replace")
    line = LineError(index + 1, custom_id, code, message).to_batch_error_line(job_id)
    return line, line_key(custom_id, f"{job_id}-line-{index + 1}")


def line_key(custom_id: str | None, line_id: str) -> str:
    """The dedupe key of one line: its custom_id, or its id when it has none (never confused)."""
    return "id:" + line_id if custom_id is None else "custom_id:" + custom_id


def _render_results(
    page: ResultPage, context: ExportContext, checked: Checked, templates: bool = True
) -> tuple[bytes, list[str] | None, list[str] | None]:
    """(output lines as one buffer, their keys, or None and their custom_ids when none is
    null) for the checked results, in page order: each form's results a whole page at once
    (line_templates.py), the rest one by one (all of them without `templates`)."""
    results = checked.results
    if not len(results):
        return b"", [], None
    hex_ids = line_ids.request_id_hex(context.job_id, page.index[results])
    custom_ids = page.custom_ids
    if len(results) != len(custom_ids):
        custom_ids = np.asarray(custom_ids, dtype=object)[results].tolist()
    keys: list[str] | None = None  # None: every line's key is its custom_id's
    if None in custom_ids:
        ids = np.ascontiguousarray(hex_ids[:, :32]).view("S32").reshape(-1).tolist()
        keys = [
            line_key(c, "batch_req_" + line_id.decode())
            for c, line_id in zip(custom_ids, ids, strict=True)
        ]
    forms = _forms(page, context, checked, templates)
    offsets = np.asarray(page.offsets, dtype=np.int64)
    starts = offsets[results]
    counts = (offsets[results + 1] - starts) // 4
    words, word_starts = result_words(page.payload, starts, counts)
    prompts = page.prompt_tokens[results]
    shape_ids = page.shape[results].astype(np.int64)
    max_tokens = np.zeros(len(results), dtype=np.int64)
    for shape_id, (_, most) in (checked.by_shape or {}).items():
        max_tokens[shape_ids == shape_id] = most
    buffers = []
    for code in np.unique(forms).tolist():
        rows = np.flatnonzero(forms == code)
        if code == len(line_templates.FORMS):
            picked = Checked(results[rows], [checked.endpoints[j] for j in rows.tolist()], *_NONE)
            data = b"".join(format_lines_one_by_one(page, context, picked))
        else:
            data = line_templates.lines(
                line_templates.FORMS[code],
                hex_ids=hex_ids[rows],
                custom_ids=[custom_ids[j] for j in rows.tolist()]
                if len(rows) < len(forms)
                else custom_ids,
                words=words,
                starts=word_starts[rows],
                counts=counts[rows],
                prompts=prompts[rows],
                max_tokens=max_tokens[rows],
                model=context.model,
                created=context.created_ns // 1_000_000_000,
                decode=context.decode,
            )
        buffers.append((rows, data))
    bare = None if keys is not None else list(custom_ids)
    if len(buffers) == 1:
        return buffers[0][1], keys, bare
    by_row = np.empty(len(results), dtype=object)  # forms mixed in one page: back in page order
    for rows, data in buffers:
        by_row[rows] = split_lines(data)
    return b"".join(by_row.tolist()), keys, bare


def _forms(
    page: ResultPage, context: ExportContext, checked: Checked, templates: bool = True
) -> np.ndarray:
    """Per checked result, its template's number in line_templates.FORMS (their count: one
    by one, as every one is without `templates`)."""
    shape_ids = page.shape[checked.results]
    forms = np.full(len(shape_ids), len(line_templates.FORMS), dtype=np.int64)
    if not templates:
        return forms
    for shape_id in np.unique(shape_ids).tolist():
        rows = np.flatnonzero(shape_ids == shape_id)
        endpoint = checked.endpoints[int(rows[0])][0]
        shape = context.shapes.get(shape_id) or {}
        form = line_templates.form_of(endpoint, shape, shape.get("top_logprobs") is not None)
        if form is not None:
            forms[rows] = line_templates.FORMS.index(form)
    return forms


def _split_error(payload: bytes) -> tuple[str, str]:
    text = payload.decode("utf-8", errors="replace")
    code, sep, message = text.partition(": ")
    if sep and _BARE_CODE.fullmatch(code):
        return code, message
    return ItemErrorCode.ITEM_FAILED, text or "the item failed and its worker gave no reason"
