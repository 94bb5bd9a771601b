"""Trust nothing a worker sends: each result is checked against its item before it is stored.

A result that completion stores must always be deliverable (`results`, the
vector sink), so completion checks every result of a RESULTS message, per
item and vectorised per message, against what its input item asked for: the
item's input segment names its model and shape, the shape names its endpoint
(and so the result kind) and, for generation, its `max_tokens`.

| cause             | the result                                                               | completion                      |
|-------------------|--------------------------------------------------------------------------|---------------------------------|
| `bad_status`      | status is neither 0 (result) nor 1 (error)                               | hands the item back             |
| `wrong_kind`      | a result (status 0) whose kind is not its endpoint's: 1 (vector) for `/v1/embeddings`, 3 (tokens with logprobs) for a shape with `top_logprobs`, 0 (tokens) otherwise | hands the item back |
| `wrong_size`      | a payload that is not a whole number of 4-byte values, an empty embedding, more tokens than the shape's `max_tokens`, or a logprobs payload whose size is not what its header says (pipeline/core/token_logprobs.py) | hands the item back |
| `wrong_dimension` | an embedding whose number of values is not the model's (below)           | hands the item back             |
| `not_finite`      | an embedding holding NaN or an infinity                                  | stores error `invalid_result` at once |

An error result (status 1) is the worker saying the item failed: it is kept,
and stored as text (kind 2) whatever kind the worker gave it.

Handing back counts an attempt (dispatch reclaims the item as
`result_refused`), so an item answered badly by a broken or lying worker is
computed again by another; one that is refused on its last attempt (its
attempts byte + 1 reaches `dispatch.max_attempts`) becomes the error result
`invalid_result: <why>` instead of a plain dead letter, so the reason reaches
the user (invariant 14). NaN or infinite values come from the model on that
input (an overflow), not from the transport: another worker gives the same,
so they are the item's own error at once.

The model's dimension is learnt, not configured: the first embedding of a
(model, lane) that passes every other check in this completion process's life
fixes it for that pair (real models have one dimension in every lane; the
`echo` test engine returns the padded prompt, one dimension per lane). A
restart learns it again. Until an honest worker has answered a (model, lane),
a worker that lies about the dimension first is believed, and the honest
results that follow are handed back, then refused on their last attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ingest.catalog import EMBEDDINGS
from pipeline.core import token_logprobs
from pipeline.core.errors import FabricError
from pipeline.core.item_error_codes import ItemErrorCode
from pipeline.core.result_kinds import ResultKind, ResultStatus
from pipeline.telemetry.metric_catalogue import RESULT_REFUSALS

OK = 0
BAD_STATUS = 1
WRONG_KIND = 2
WRONG_SIZE = 3
WRONG_DIMENSION = 4
NOT_FINITE = 5
CAUSES = ("ok", *RESULT_REFUSALS)  # indexed by the codes above
HAND_BACK = (BAD_STATUS, WRONG_KIND, WRONG_SIZE, WRONG_DIMENSION)  # the worker's fault


@dataclass(frozen=True)
class Expected:
    """What each item of a RESULTS message must look like (one entry per item)."""

    kind: np.ndarray  # u1: a ResultKind, VECTOR or TOKENS; 0xFF when unknown (not checked)
    max_tokens: np.ndarray  # i8: generation's output budget; 0 = not checked
    dim_key: list[tuple[str, int]]  # the distinct (model, lane) pairs of the message
    dim_of: np.ndarray  # i8 per item: its pair's index in dim_key (-1: not checked)


@dataclass(eq=False)
class Verdict:
    cause: np.ndarray  # u1 per item: OK or a cause
    detail: dict[int, str] = field(default_factory=dict)  # cause -> one example, for the log

    def reason(self, cause: int) -> str:
        """The stored error text for items refused with `cause`."""
        example = self.detail.get(cause, "")
        return (
            f"{ItemErrorCode.INVALID_RESULT}: the worker's result was refused ({CAUSES[cause]}; "
            f"the first so refused in its batch had {example})"
        )


class ResultCheck:
    """Checks results against their items; learns each (model, lane)'s embedding dimension."""

    def __init__(self) -> None:
        self.dims: dict[tuple[str, int], int] = {}

    def check(
        self,
        expected: Expected,
        status: np.ndarray,
        kind: np.ndarray,
        payload: np.ndarray,
        offsets: np.ndarray,
    ) -> Verdict:
        """Per item, OK or why its result cannot be stored as it is (see the module table).

        `offsets` (i8, n + 1) must already be known to lie inside `payload`
        (collector/completion/intake.py `results_problem`)."""
        n = len(status)
        cause = np.zeros(n, np.uint8)
        detail: dict[int, str] = {}

        def refuse(mask: np.ndarray, why: int, what) -> None:
            """Mark the items of `mask` not refused yet; `what(i)` describes the first, i."""
            mask = mask & (cause == OK)
            if mask.any():
                cause[mask] = why
                detail.setdefault(why, what(int(np.argmax(mask))))

        status = status.astype(np.int64)
        kind = kind.astype(np.int64)
        sizes = np.diff(offsets)
        result = status == ResultStatus.RESULT
        refuse(
            ~result & (status != ResultStatus.ERROR),
            BAD_STATUS,
            lambda i: (
                f"status {status[i]}, not {int(ResultStatus.RESULT)} (result) or "
                f"{int(ResultStatus.ERROR)} (error)"
            ),
        )
        want = expected.kind.astype(np.int64)
        known = want != 0xFF
        refuse(
            result & known & (kind != want),
            WRONG_KIND,
            lambda i: f"kind {kind[i]} where the item's endpoint gives kind {want[i]}",
        )
        refuse(
            result
            & (kind != ResultKind.TOKENS)
            & (kind != ResultKind.VECTOR)
            & (kind != ResultKind.TOKEN_LOGPROBS),
            WRONG_KIND,
            lambda i: (
                f"kind {kind[i]}, not {int(ResultKind.TOKENS)} (tokens), "
                f"{int(ResultKind.VECTOR)} (vector) or {int(ResultKind.TOKEN_LOGPROBS)} "
                "(tokens with logprobs)"
            ),
        )
        refuse(
            result & (sizes % 4 != 0),
            WRONG_SIZE,
            lambda i: f"a {sizes[i]}-byte payload, not whole 4-byte values",
        )
        vectors = result & (kind == ResultKind.VECTOR)
        refuse(vectors & (sizes == 0), WRONG_SIZE, lambda i: "an empty embedding")
        budget = expected.max_tokens
        refuse(
            result & (kind == ResultKind.TOKENS) & (budget > 0) & (sizes // 4 > budget),
            WRONG_SIZE,
            lambda i: f"{sizes[i] // 4} tokens where the shape's max_tokens is {budget[i]}",
        )
        self._logprob_sizes(
            result & (kind == ResultKind.TOKEN_LOGPROBS), payload, offsets, budget, refuse, cause
        )
        vectors &= cause == OK
        broken = _not_finite(payload, offsets, vectors) if vectors.any() else vectors
        self._dimensions(expected, vectors, vectors & ~broken, sizes // 4, refuse)
        refuse(broken, NOT_FINITE, lambda i: "NaN or infinite values")  # worker's faults first
        return Verdict(cause, detail)

    @staticmethod
    def _logprob_sizes(mine, payload, offsets, budget, refuse, cause) -> None:
        """Refuse TOKEN_LOGPROBS payloads shorter than their header, of another size than it
        says, or with more tokens than the shape's max_tokens."""
        mine = mine & (cause == OK)
        if not mine.any():
            return
        sizes = np.diff(offsets)
        refuse(mine & (sizes < 8), WRONG_SIZE, lambda i: f"a {sizes[i]}-byte logprobs payload")
        mine = mine & (cause == OK)
        where = np.flatnonzero(mine)
        m = np.zeros(len(sizes), np.int64)
        k = np.zeros(len(sizes), np.int64)
        m[where], k[where] = token_logprobs.headers(payload, offsets[:-1][where])
        words = token_logprobs.HEADER_WORDS + m * (2 + 2 * k)
        refuse(
            mine & (sizes != 4 * words),
            WRONG_SIZE,
            lambda i: f"a {sizes[i]}-byte logprobs payload whose header says {m[i]} x {k[i]}",
        )
        refuse(
            mine & (budget > 0) & (m > budget),
            WRONG_SIZE,
            lambda i: f"{m[i]} tokens where the shape's max_tokens is {budget[i]}",
        )

    def _dimensions(self, expected: Expected, vectors, finite, dims, refuse) -> None:
        """Refuse embeddings whose length is not their (model, lane)'s, learning it from the
        first finite one that passed the other checks."""
        for k in np.unique(expected.dim_of[vectors]).tolist():
            if k < 0:
                continue
            key = expected.dim_key[k]
            mine = vectors & (expected.dim_of == k)
            dim = self.dims.get(key)
            if dim is None:
                if not (finite & mine).any():
                    continue
                dim = self.dims[key] = int(dims[np.argmax(finite & mine)])
            refuse(
                mine & (dims != dim),
                WRONG_DIMENSION,
                lambda i, key=key, dim=dim: (
                    f"{dims[i]} values where {key[0]} in lane {key[1]} gives {dim}"
                ),
            )


def expected_kind(shape: dict | None) -> int:
    """The result kind an item of `shape` gets: VECTOR for embeddings, TOKEN_LOGPROBS for a
    shape with top_logprobs, TOKENS otherwise; 0xFF when the shape is unknown."""
    if not shape or "endpoint" not in shape:
        return 0xFF
    if shape["endpoint"] == EMBEDDINGS:
        return ResultKind.VECTOR
    if shape.get("top_logprobs") is not None:
        return ResultKind.TOKEN_LOGPROBS
    return ResultKind.TOKENS


def _not_finite(payload: np.ndarray, offsets: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Per item, True where one of the picked items' f4 values is NaN or infinite."""
    starts = offsets[:-1][pick]
    ends = offsets[1:][pick]
    bad = np.zeros(len(pick), bool)
    for phase in np.unique(starts % 4).tolist():  # one pass over the payload per start phase
        mine = starts % 4 == phase
        words = payload[phase : phase + (len(payload) - phase) // 4 * 4].view("<f4")
        at = np.flatnonzero(~np.isfinite(words)) * 4 + phase  # usually none: nothing more
        if not len(at):
            continue
        first, last = starts[mine], ends[mine]  # ascending: offsets never decrease
        owner = np.searchsorted(first, at, side="right") - 1
        inside = owner >= 0
        inside[inside] = at[inside] < last[owner[inside]]
        bad[np.flatnonzero(pick)[np.flatnonzero(mine)[owner[inside]]]] = True
    return bad


def expected_for(items: np.ndarray, open_input, shapes) -> tuple[Expected, np.ndarray]:
    """What each item's result must look like, and each item's attempts so far (the marker's
    attempts byte), read from its input segment and shape (`open_input(segment_id)`, the
    shape table: pipeline.store.intern_table.InternTable). An item whose segment cannot be opened, or
    whose slot is outside it, is not checked here: the completion log refuses it (its seq cannot match)."""
    n = len(items)
    kind = np.full(n, 0xFF, np.uint8)
    max_tokens = np.zeros(n, np.int64)
    dim_of = np.full(n, -1, np.int64)
    attempts = np.zeros(n, np.int64)
    dim_key: list[tuple[str, int]] = []
    for segment_id in np.unique(items["segment"]).tolist():
        try:
            seg = open_input(int(segment_id))
        except (FabricError, OSError):
            continue
        mine = items["segment"] == segment_id
        shape = shapes.get(seg.key.shape)
        kind[mine] = expected_kind(shape)
        if shape and shape.get("endpoint") != EMBEDDINGS:
            budget = shape.get("max_tokens")
            max_tokens[mine] = budget if isinstance(budget, int) and budget > 0 else 0
        dim_of[mine] = len(dim_key)
        dim_key.append((seg.key.name, seg.key.lane))
        slots = items["slot"][mine].astype(np.int64)
        inside = slots < seg.capacity
        where = np.flatnonzero(mine)[inside]
        attempts[where] = seg.attempts(slots[inside])
    return Expected(kind, max_tokens, dim_key, dim_of), attempts
