"""A result page as the broker sends it to a results client, and its checks before rendering.

`ResultPage` holds one page's columns; `ExportContext` what rendering needs
from the page's job; `check_page` sorts the page's entries into results to
render, stored errors, and stored results that cannot be rendered (each of
those becomes an `invalid_result` error line, collector/delivery/lines.py),
and raises `PageError` when the page's columns disagree. The error codes the
client itself gives (`item_failed`, `invalid_result`) live here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingest.catalog import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES
from pipeline.core.errors import FabricError
from pipeline.core.ragged import offsets_problem, ranges
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.core.token_logprobs import HEADER_WORDS, headers


class PageError(FabricError):
    """A result page from the broker is malformed; the message names the job, item and field."""


@dataclass(eq=False)
class ResultPage:
    """One page of a job's stored results, as the broker sends it to a results client."""

    index: np.ndarray  # u4: the item's index in the job (line number - 1)
    custom_ids: list[str | None]  # None when the input line had no readable custom_id
    status: np.ndarray  # u1: a ResultStatus
    kind: np.ndarray  # u1: a ResultKind
    shape: np.ndarray  # u2: the item's shape id (0 = unknown)
    prompt_tokens: np.ndarray  # u4: prompt length in tokens
    payload: np.ndarray  # u1: every item's payload back to back
    offsets: np.ndarray  # i8, n + 1
    part: np.ndarray | None = None  # u4: each row's part when the page joins fan-out lines


@dataclass(frozen=True)
class ExportContext:
    """What a page needs from its job: ids, model name, shape table, tokenizer, creation time."""

    job_id: str
    model: str
    shapes: Mapping[int, Mapping[str, Any]]  # shape id -> shape dict ("endpoint", "max_tokens")
    decode: Callable[[list[int]], str] | None = None  # token ids -> text; None gives ""
    created_ns: int = 0  # the job's creation time (job.json created_ns)


@dataclass(eq=False)
class Checked:
    """A page sorted out: the positions of results to render (and their (endpoint, max_tokens)),
    of stored errors, and of stored results that cannot be rendered (position -> why)."""

    results: np.ndarray
    endpoints: list[tuple[str, int]]
    errors: np.ndarray
    invalid: dict[int, str]
    by_shape: dict[int, tuple[str, int]] | None = None  # shape id -> (endpoint, max_tokens)


def check_page(page: ResultPage, context: ExportContext) -> Checked:
    """Sort the page's entries; raise PageError if its columns disagree (nothing is usable).

    Belt and braces: completion checks every result before it stores it
    (collector/completion/result_check.py), but a page read from older data may still
    hold one that cannot be rendered (a status, kind or size its shape does
    not allow, NaN or infinite values): each such entry becomes an
    `invalid_result` error line, so the rest of the page is still delivered.
    """
    job_id = context.job_id
    n = len(page.index)
    columns = {
        "custom_ids": len(page.custom_ids),
        "status": len(page.status),
        "kind": len(page.kind),
        "shape": len(page.shape),
        "prompt_tokens": len(page.prompt_tokens),
        "offsets": len(page.offsets) - 1,
    }
    for name, length in columns.items():
        if length != n:
            raise PageError(
                f"job {job_id}: result page column {name} has {length} entries for {n} items "
                "(offsets needs n + 1); the broker sent a malformed page, report it with the job id"
            )
    problem = offsets_problem(np.asarray(page.offsets), n, len(page.payload))
    if problem:
        raise PageError(
            f"job {job_id}: result page offsets over its {len(page.payload)}-byte payload are "
            f"wrong ({problem}); the broker sent a malformed page, report it with the job id"
        )
    offsets = np.asarray(page.offsets, dtype=np.int64)
    invalid: dict[int, str] = {}
    status, kind = page.status, page.kind
    sizes = np.diff(offsets)
    results = status == ResultStatus.RESULT
    errors = status == ResultStatus.ERROR
    for i in np.flatnonzero(~results & ~errors).tolist():
        invalid[i] = (
            f"has status {int(status[i])}, not {int(ResultStatus.RESULT)} or "
            f"{int(ResultStatus.ERROR)}"
        )
    for i in np.flatnonzero(results & (sizes % 4 != 0)).tolist():
        invalid[i] = f"has a {int(sizes[i])}-byte payload, not a whole number of u4/f4 values"
    scored = np.flatnonzero(results & (kind == ResultKind.TOKEN_LOGPROBS))
    for i in scored[sizes[scored] < 8].tolist():
        invalid[i] = f"is a {int(sizes[i])}-byte logprobs payload, shorter than its header"
    scored = scored[sizes[scored] >= 8]
    if len(scored):
        m, k = headers(page.payload, offsets[scored])
        wrong = sizes[scored] != 4 * (HEADER_WORDS + m * (2 + 2 * k))
        for i in scored[wrong].tolist():
            invalid.setdefault(i, f"is a {int(sizes[i])}-byte logprobs payload its header denies")
    endpoints = endpoints_of(context, page.shape, kind, results, invalid)
    embeds = np.flatnonzero(results & (kind == ResultKind.VECTOR))
    embeds = embeds[[i not in invalid for i in embeds.tolist()]] if invalid else embeds
    if len(embeds):
        counts = sizes[embeds] // 4
        words, word_starts = result_words(page.payload, offsets[embeds], counts)
        floats = words[ranges(word_starts, counts)].view("<f4")
        owner = np.repeat(np.arange(len(embeds)), counts)
        for i in embeds[np.unique(owner[~np.isfinite(floats)])].tolist():
            invalid[i] = "is an embedding with NaN or infinite values"
        for i in embeds[sizes[embeds] == 0].tolist():
            invalid[i] = "is an empty embedding"
    ok = np.flatnonzero(results)
    if invalid:
        ok = ok[[i not in invalid for i in ok.tolist()]]
    shapes = list(map(endpoints.__getitem__, page.shape[ok].tolist()))
    return Checked(ok, shapes, np.flatnonzero(errors), invalid, endpoints)


def endpoints_of(
    context: ExportContext,
    shape_ids: np.ndarray,
    kind: np.ndarray,
    results: np.ndarray,
    invalid: dict[int, str],
) -> dict[int, tuple[str, int]]:
    """(endpoint, max_tokens) per shape id of the results, each shape checked once against the
    kinds it carries; a result its shape does not allow goes to `invalid` with the reason."""
    table: dict[int, tuple[str, int]] = {}
    for shape_id in np.unique(shape_ids[results]).tolist():
        mine = results & (shape_ids == shape_id)
        shape = context.shapes.get(shape_id) or {}
        endpoint = shape.get("endpoint")
        max_tokens = shape.get("max_tokens")
        want = ResultKind.VECTOR if endpoint == EMBEDDINGS else ResultKind.TOKENS
        if endpoint != EMBEDDINGS and shape.get("top_logprobs") is not None:
            want = ResultKind.TOKEN_LOGPROBS
        problem = ""
        if not shape:
            problem = f"names shape {shape_id}, which the job's shape table does not hold"
        elif endpoint not in (EMBEDDINGS, CHAT_COMPLETIONS, COMPLETIONS, RESPONSES):
            problem = f"has shape {shape_id} with endpoint {endpoint!r}"
        elif endpoint != EMBEDDINGS and (not isinstance(max_tokens, int) or max_tokens < 1):
            problem = (
                f"has shape {shape_id} ({endpoint}) with max_tokens {max_tokens!r}, "
                "not a positive integer"
            )
        if problem:
            for i in np.flatnonzero(mine).tolist():
                invalid.setdefault(i, problem)
            continue
        for i in np.flatnonzero(mine & (kind != want)).tolist():
            what = f"is a kind {int(kind[i])} result, but its shape {shape_id} is {endpoint}"
            invalid.setdefault(i, f"{what}, which gives kind {int(want)}")
        table[shape_id] = (endpoint, max_tokens or 0)
    return table


def result_words(
    payload: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every result's payload as little-endian u4 words, and where each result's words start.

    When every payload starts on a 4-byte boundary this is one view of the
    page, with no copy; otherwise (error text between results) the words are
    gathered per start phase, four vectorized copies at most.
    """
    buffer = np.ascontiguousarray(payload, dtype=np.uint8)
    phases = starts % 4
    if not phases.any():
        return buffer[: len(buffer) // 4 * 4].view("<u4"), starts // 4
    word_starts = np.cumsum(counts) - counts
    words = np.empty(int(counts.sum()), dtype="<u4")
    for phase in range(4):
        mine = phases == phase
        if mine.any():
            view = buffer[phase : phase + (len(buffer) - phase) // 4 * 4].view("<u4")
            source = ranges(starts[mine] // 4, counts[mine])
            words[ranges(word_starts[mine], counts[mine])] = view[source]
    return words, word_starts
