"""The page-at-once line templates give exactly the bytes of the line-by-line formatter.

`render_page` builds the common forms (completions, chat, embeddings as
numbers and as base64) from templates (collector/delivery/line_templates.py)
and leaves the rest to the line-by-line formatter, which builds each line's
dict and hands it to orjson. These pages mix every form, errors, results that
cannot be rendered, custom_ids that need escaping or are missing, payloads
off the 4-byte grid, and fan-out lines joined; one byte of difference fails.
Each page is held twice: against the line-by-line formatter run now, and
against the digest of what the formatter before the templates (commit
7d54afd, `format_page` and `page_keys`) wrote for it (see BEFORE).
"""

from __future__ import annotations

import hashlib

import numpy as np
import orjson
import pytest

from collector.delivery.result_page import ExportContext, ResultPage
from pipeline.core.token_logprobs import pack

EMBED, BASE64, CHAT, COMPLETE, CHAT_SCORED, COMPLETE_SCORED, RESPOND = 1, 2, 3, 4, 5, 6, 7
COMPLETE_LONG = 8
SHAPES = {
    EMBED: {"endpoint": "/v1/embeddings", "max_tokens": None},
    BASE64: {"endpoint": "/v1/embeddings", "max_tokens": None, "encoding_format": "base64"},
    CHAT: {"endpoint": "/v1/chat/completions", "max_tokens": 4},
    COMPLETE: {"endpoint": "/v1/completions", "max_tokens": 3},
    CHAT_SCORED: {"endpoint": "/v1/chat/completions", "max_tokens": 3, "top_logprobs": 2},
    COMPLETE_SCORED: {"endpoint": "/v1/completions", "max_tokens": 8, "top_logprobs": 2},
    RESPOND: {"endpoint": "/v1/responses", "max_tokens": 5, "temperature": 0.5},
    COMPLETE_LONG: {"endpoint": "/v1/completions", "max_tokens": 8},
}
CREATED_NS = 1_700_000_123_456_789_000
MODEL = 'tiny-"model"-é'
CUSTOM_IDS = ("plain", 'q"uote', "back\\slash", "ünï-€-😀", "tab\tnew\nline", "\x01ctl", "")
CUSTOM_IDS += (None,)

# sha256 of (out lines, error lines, out keys, error keys) that commit 7d54afd's format_page
# and page_keys gave for each page below (its formatter built one dict per line), with one change
# made since on purpose: a /v1/responses body carries OpenAI's `top_logprobs` field (null when
# not asked for), so the pages holding a response line were pinned again after that change
BEFORE = {
    ("mixed", False): "a3a0179044630e44a480e4afe87749ac1ab1246af5a9cb6165df10bc814134d9",
    ("mixed", True): "f563d1d8dd278278e8d95f54d82d4759d77487bbe2b85c924b2e7036866bbf82",
    ("fanout", False): "b921481449708e9b20f9a2a769534b92c011832c89d2264921e2bdb51f84d14c",
    ("fanout", True): "c2be7e9c618184557762fa474eef4abccd80de36173f90abd9d5388607978ee3",
    ("random", False): "5597b3ae452f842acf14dc532d2d5480458f3b8d09fb956a260a076b08a79bb3",
    ("random", True): "ffb44ae478130c65323ea0da6bd7fc18c521bec519bc3db63ca8c67548128e14",
}


def decode(ids: list[int]) -> str:
    return "".join(f'<{i}é\n"{"😀" if i % 7 == 0 else ""}>' for i in ids)


def tokens(*ids: int) -> tuple[int, int, bytes]:
    return 0, 0, np.array(ids, dtype="<u4").tobytes()


def floats(*values: float) -> tuple[int, int, bytes]:
    return 0, 1, np.array(values, dtype="<f4").tobytes()


def scored(m: int, seed: int) -> tuple[int, int, bytes]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, m)
    top = rng.integers(0, 50, (m, 2))
    values = -rng.random((m, 3)).astype(np.float32)
    return 0, 3, pack(ids, values[:, 0], top, values[:, 1:])


def failure(text: bytes) -> tuple[int, int, bytes]:
    return 1, 2, text


def page_of(items: list[tuple], part: list[int] | None = None) -> ResultPage:
    """items: (index, custom_id, shape, prompt_tokens, (status, kind, payload)) per item."""
    payloads = [payload for *_, (_, _, payload) in items]
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in payloads])
    return ResultPage(
        index=np.array([item[0] for item in items], dtype=np.uint32),
        custom_ids=[item[1] for item in items],
        status=np.array([s for *_, (s, _, _) in items], dtype=np.uint8),
        kind=np.array([k for *_, (_, k, _) in items], dtype=np.uint8),
        shape=np.array([item[2] for item in items], dtype=np.uint16),
        prompt_tokens=np.array([item[3] for item in items], dtype=np.uint32),
        payload=np.frombuffer(b"".join(payloads), dtype=np.uint8),
        offsets=offsets,
        part=None if part is None else np.array(part, dtype=np.uint32),
    )


def mixed_page() -> ResultPage:
    tiny, huge = np.float32(1e-7).item(), np.float32(3.4e38).item()
    return page_of(
        [
            (0, "plain", COMPLETE, 5, tokens(1, 2, 3)),  # reaches max_tokens: "length"
            (1, 'q"uote', COMPLETE, 0, tokens(7)),
            (2, "back\\slash", COMPLETE, 9, tokens()),  # nothing generated
            (3, "e-1", EMBED, 4, floats(0.5, -0.25, 0.1)),
            (4, "bad", EMBED, 3, failure(b"oom: out of memory")),  # 18 bytes: off the grid
            (5, "ünï-€-😀", EMBED, 2, floats(tiny, -huge, -0.0, 1 / 3, 2.5e-12)),
            (6, "b64", BASE64, 1, floats(1.0, -2.5, 0.1)),
            (7, None, CHAT, 3, tokens(14, 15, 16, 17, 18)),
            (8, "tab\tnew\nline", CHAT, 12, tokens(21)),
            (9, "no-code", CHAT, 1, failure(b"the worker fell over!")),
            (10, "\x01ctl", CHAT_SCORED, 4, scored(3, 1)),
            (11, "scored-c", COMPLETE_SCORED, 4, scored(2, 2)),
            (12, "resp", RESPOND, 6, tokens(30, 31)),
            (13, "wrong-kind", EMBED, 2, tokens(1, 2)),  # cannot be rendered: an error line
            (14, None, BASE64, 8, floats(*np.linspace(-1, 1, 7).tolist())),
            (15, "", COMPLETE, 1, tokens(4_294_967_295, 0)),
            (16, None, CHAT, 2, failure(b"x")),
            (17, "nan", EMBED, 1, floats(float("nan"), 1.0)),  # cannot be rendered
        ]
    )


def fanout_page() -> ResultPage:
    rows = [  # (line index, part, custom_id, shape, prompt, result)
        (0, 0, "fan-e", EMBED, 3, floats(0.25, 0.5)),
        (0, 1, "fan-e", EMBED, 3, floats(-1.0, 2.0)),
        (1, 1, "fan-c", COMPLETE, 4, tokens(5)),
        (1, 0, "fan-c", COMPLETE, 4, tokens(6, 7, 8)),
        (1, 2, "fan-c", COMPLETE, 4, tokens()),
        (2, 0, None, CHAT, 2, tokens(9, 10)),
        (2, 1, None, CHAT, 2, tokens(11)),
        (3, 0, "fan-bad", CHAT, 2, tokens(1)),
        (3, 1, "fan-bad", CHAT, 2, failure(b"timeout: too slow")),
        (4, 0, "fan-b64", BASE64, 1, floats(3.0, 4.0, 5.0)),
    ]
    items = [(i, c, s, p, r) for i, _, c, s, p, r in rows]
    return page_of(items, part=[p for _, p, *_ in rows])


def random_page(n: int = 3000, seed: int = 5) -> ResultPage:
    rng = np.random.default_rng(seed)
    items = []
    for index in range(n):
        shape = int(rng.choice([EMBED, BASE64, CHAT, COMPLETE, CHAT_SCORED, RESPOND]))
        custom_id = CUSTOM_IDS[int(rng.integers(len(CUSTOM_IDS)))]
        custom_id = None if custom_id is None else f"{custom_id}-{index}"
        if rng.random() < 0.05:
            result = failure(b"e" * int(rng.integers(1, 9)))
        elif shape in (EMBED, BASE64):
            dim = int(rng.choice([3, 4, 8]))
            result = floats(*(rng.standard_normal(dim) * 10.0 ** rng.integers(-8, 8)).tolist())
        elif shape == CHAT_SCORED:
            result = scored(int(rng.integers(0, 4)), index)
        else:
            result = tokens(*rng.integers(0, 200_000, int(rng.integers(0, 6))).tolist())
        items.append((index, custom_id, shape, int(rng.integers(0, 5000)), result))
    return page_of(items)


PAGES = {"mixed": mixed_page, "fanout": fanout_page, "random": random_page}


def alike_page(finishes: str) -> ResultPage:
    """Rows of one length per form, as a real job's page mostly is (the templates' short
    cuts: one orjson block split without a column; one finish_reason folded into the fixed
    part, or two when the lines reach different max_tokens)."""
    long = COMPLETE_LONG if finishes == "two" else COMPLETE
    items = [
        (0, "a", COMPLETE, 7, tokens(1, 2, 3)),  # max_tokens 3: "length"
        (1, "bb", long, 8, tokens(40_000, 5, 6)),  # "stop" under COMPLETE_LONG
        (2, "ccc-\u00e9", COMPLETE, 9, tokens(7, 8, 9)),
        (3, None, CHAT, 1, tokens(10, 11, 12, 13)),
        (4, "chat-2", CHAT, 2, tokens(14, 15, 16, 17)),
        (5, "e1", EMBED, 3, floats(0.5, -1.25)),
        (6, "e2", EMBED, 3, floats(1e-7, 3.0)),
    ]
    return page_of(items)


def context(with_decode: bool) -> ExportContext:
    return ExportContext(
        "job-7", MODEL, SHAPES, decode=decode if with_decode else None, created_ns=CREATED_NS
    )


def digest_of(out: list[bytes], err: list[bytes], out_keys: list, err_keys: list) -> str:
    whole = b"".join(out) + b"--\n" + b"".join(err) + b"--\n"
    whole += orjson.dumps(out_keys) + orjson.dumps(err_keys)
    return hashlib.sha256(whole).hexdigest()


def one_by_one(page: ResultPage, ctx: ExportContext) -> tuple[bytes, list[str]]:
    """The output lines and keys of the line-by-line formatter (no templates)."""
    from collector.delivery.lines import format_lines_one_by_one, line_key
    from collector.delivery.result_page import check_page

    checked = check_page(page, ctx)
    lines = format_lines_one_by_one(page, ctx, checked)
    keys = []
    for i, line in zip(checked.results.tolist(), lines, strict=True):
        keys.append(line_key(page.custom_ids[i], orjson.loads(line)["id"]))
    return b"".join(lines), keys


@pytest.mark.parametrize("with_decode", [False, True], ids=["no tokenizer", "tokenizer"])
@pytest.mark.parametrize("name", ["mixed", "random"])
def test_templates_write_the_bytes_of_the_line_by_line_formatter(name, with_decode):
    from collector.delivery.lines import render_page

    page, ctx = PAGES[name](), context(with_decode)
    rendered = render_page(page, ctx)
    out, keys = one_by_one(page, ctx)
    assert rendered.out == out  # every byte, in page order
    assert rendered.out_keys == keys
    assert len(rendered.out_keys) == rendered.out.count(b"\n")


@pytest.mark.parametrize("with_decode", [False, True], ids=["no tokenizer", "tokenizer"])
@pytest.mark.parametrize("finishes", ["one", "two"])
def test_pages_of_alike_rows_write_the_bytes_of_the_line_by_line_formatter(finishes, with_decode):
    from collector.delivery.lines import render_page

    page, ctx = alike_page(finishes), context(with_decode)
    rendered = render_page(page, ctx)
    out, keys = one_by_one(page, ctx)
    assert rendered.out == out
    assert rendered.out_keys == keys
    assert (b'"finish_reason":"stop"' in out) == (finishes == "two")


@pytest.mark.parametrize("with_decode", [False, True], ids=["no tokenizer", "tokenizer"])
@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_page_renders_as_the_formatter_before_the_templates_did(name, with_decode):
    from collector.delivery.lines import format_page, page_keys, render_page

    page, ctx = PAGES[name](), context(with_decode)
    out, err = format_page(page, ctx)
    digest = digest_of(out, err, *page_keys(page, ctx))
    assert digest == BEFORE[name, with_decode]
    rendered = render_page(page, ctx)
    assert rendered.out == b"".join(out) and rendered.err == b"".join(err)


def test_the_templated_forms_are_what_the_mixed_page_holds():
    """The pinned pages go through every template (and the line-by-line path too)."""
    from collector.delivery import line_templates
    from collector.delivery.lines import _forms
    from collector.delivery.result_page import check_page

    page, ctx = mixed_page(), context(False)
    forms = _forms(page, ctx, check_page(page, ctx))
    assert set(forms.tolist()) == set(range(len(line_templates.FORMS) + 1))


if __name__ == "__main__":  # print BEFORE for the formatter on sys.path (run from its tree)
    from collector.delivery.lines import format_page, page_keys

    for name, make in PAGES.items():
        for with_decode in (False, True):
            page, ctx = make(), context(with_decode)
            out, err = format_page(page, ctx)
            print(f'    ("{name}", {with_decode}): "{digest_of(out, err, *page_keys(page, ctx))}",')
