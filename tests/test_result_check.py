"""Completion checks every worker result against its item before it stores it (issue 14, 2 and 11).

The real-process test (a lying worker, then `results --all`) is in
tests/test_dispatch_pipeline.py; these drive `ResultCheck` one message at a time.
"""

from __future__ import annotations

import numpy as np

from collector.completion.result_check import (
    BAD_STATUS,
    NOT_FINITE,
    OK,
    WRONG_DIMENSION,
    WRONG_KIND,
    WRONG_SIZE,
    Expected,
    ResultCheck,
)
from pipeline.core.result_kinds import ResultKind


def message(
    parts: list[tuple[int, int, bytes]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(status, kind, payload, offsets) of one RESULTS message from (status, kind, bytes) per item."""
    status = np.array([p[0] for p in parts], np.uint8)
    kind = np.array([p[1] for p in parts], np.uint8)
    payload = np.frombuffer(b"".join(p[2] for p in parts), np.uint8)
    offsets = np.concatenate(([0], np.cumsum([len(p[2]) for p in parts]))).astype(np.int64)
    return status, kind, payload, offsets


def expect(kind: int, n: int, max_tokens: int = 0, key=("m", 64)) -> Expected:
    return Expected(
        np.full(n, kind, np.uint8), np.full(n, max_tokens, np.int64), [key], np.zeros(n, np.int64)
    )


def vec(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


def test_every_cause_is_told_apart_per_item():
    parts = [
        (0, ResultKind.VECTOR, vec(1, 2, 3)),  # the first good embedding: dim 3 for (m, 64)
        (0, ResultKind.VECTOR, vec(1, 2)),  # another dimension
        (0, ResultKind.VECTOR, vec(1, float("nan"), 3)),
        (0, ResultKind.VECTOR, vec(float("-inf"), 0, 0)),
        (
            0,
            ResultKind.TOKENS,
            np.array([1, 2, 3], "<u4").tobytes(),
        ),  # tokens for an embedding item
        (0, ResultKind.VECTOR, b"\x00" * 10),  # not whole floats
        (0, ResultKind.VECTOR, b""),  # empty
        (7, ResultKind.VECTOR, vec(1, 2, 3)),  # status out of range
        (1, ResultKind.TOKENS, b"engine said no"),  # an error: kept whatever its kind
        (0, 9, vec(1, 2, 3)),  # no such kind
    ]
    verdict = ResultCheck().check(expect(ResultKind.VECTOR, len(parts)), *message(parts))
    assert verdict.cause.tolist() == [
        OK,
        WRONG_DIMENSION,
        NOT_FINITE,
        NOT_FINITE,
        WRONG_KIND,
        WRONG_SIZE,
        WRONG_SIZE,
        BAD_STATUS,
        OK,
        WRONG_KIND,
    ]
    assert verdict.reason(WRONG_DIMENSION).startswith("invalid_result: ")
    assert "2 values where m in lane 64 gives 3" in verdict.reason(WRONG_DIMENSION)


def test_the_dimension_learnt_holds_for_later_messages_and_per_model_and_lane():
    check = ResultCheck()
    first = check.check(expect(ResultKind.VECTOR, 1), *message([(0, ResultKind.VECTOR, vec(1, 2))]))
    assert first.cause.tolist() == [OK]
    later = check.check(
        expect(ResultKind.VECTOR, 2),
        *message([(0, ResultKind.VECTOR, vec(1, 2, 3)), (0, ResultKind.VECTOR, vec(4, 5))]),
    )
    assert later.cause.tolist() == [WRONG_DIMENSION, OK]
    other_lane = check.check(
        expect(ResultKind.VECTOR, 1, key=("m", 128)),
        *message([(0, ResultKind.VECTOR, vec(1, 2, 3))]),
    )
    assert other_lane.cause.tolist() == [OK]


def test_generation_is_checked_against_its_budget_and_kind():
    parts = [
        (0, ResultKind.TOKENS, np.arange(4, dtype="<u4").tobytes()),
        (0, ResultKind.TOKENS, np.arange(5, dtype="<u4").tobytes()),  # over max_tokens 4
        (0, ResultKind.VECTOR, vec(1.0)),  # an embedding for a generation item
        (0, ResultKind.TOKENS, b"\x01\x02"),
        (1, ResultKind.TEXT, b"too long"),
    ]
    verdict = ResultCheck().check(
        expect(ResultKind.TOKENS, len(parts), max_tokens=4), *message(parts)
    )
    assert verdict.cause.tolist() == [OK, WRONG_SIZE, WRONG_KIND, WRONG_SIZE, OK]


def test_an_item_whose_input_is_unknown_is_checked_only_for_what_needs_no_item():
    parts = [
        (0, ResultKind.VECTOR, vec(1, 2)),
        (0, ResultKind.TOKENS, b"\x01"),
        (0, ResultKind.VECTOR, vec(float("nan"))),
    ]
    expected = Expected(
        np.full(3, 0xFF, np.uint8), np.zeros(3, np.int64), [], np.full(3, -1, np.int64)
    )
    verdict = ResultCheck().check(expected, *message(parts))
    assert verdict.cause.tolist() == [OK, WRONG_SIZE, NOT_FINITE]


def test_unaligned_embeddings_are_checked_for_nan_too():
    parts = [
        (1, ResultKind.TEXT, b"abc"),
        (0, ResultKind.VECTOR, vec(1, float("nan"))),
        (0, ResultKind.VECTOR, vec(1, 2)),
    ]
    verdict = ResultCheck().check(expect(ResultKind.VECTOR, 3), *message(parts))
    assert verdict.cause.tolist() == [OK, NOT_FINITE, OK]


def test_a_nan_embedding_first_does_not_fix_the_dimension():
    check = ResultCheck()
    parts = [
        (0, ResultKind.VECTOR, vec(float("nan"), 1)),
        (0, ResultKind.VECTOR, vec(1, 2, 3)),
        (0, ResultKind.VECTOR, vec(4, 5, 6)),
    ]
    verdict = check.check(expect(ResultKind.VECTOR, 3), *message(parts))
    assert verdict.cause.tolist() == [WRONG_DIMENSION, OK, OK]  # the worker's fault comes first
    assert check.dims == {("m", 64): 3}


def test_non_finite_values_are_found_in_the_right_item_at_any_alignment():
    rng = np.random.default_rng(7)
    parts, want = [], []
    for i in range(300):
        if i % 7 == 3:
            parts.append(
                (1, ResultKind.TEXT, b"x" * int(rng.integers(1, 6)))
            )  # shifts what follows
            want.append(OK)
            continue
        values = rng.random(16).astype("<f4")
        broken = rng.random() < 0.3
        if broken:
            values[rng.integers(0, 16)] = rng.choice([np.nan, np.inf, -np.inf])
        parts.append((0, ResultKind.VECTOR, values.tobytes()))
        want.append(NOT_FINITE if broken else OK)
    verdict = ResultCheck().check(expect(ResultKind.VECTOR, len(parts)), *message(parts))
    assert verdict.cause.tolist() == want
