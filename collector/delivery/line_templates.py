"""Output lines of a whole page at once: one template per line form, its columns filled in C.

The lines of one form differ only in a few values (id, custom_id, request_id,
the token ids or the embedding, the counts), so a page's lines are built as a
template (the constant bytes between those values, fixed by the form, the
model and the creation time) and one column of bytes per value: numbers
converted by numpy, token ids and embeddings serialised by orjson one 2-D
array per row length, custom_ids by orjson in one call. A value that takes
one of two forms (finish_reason) is a column of two shared objects, or a
constant folded into its neighbours when the page has one form only; values
repeated across lines (usage) are rendered once each. `fill` interleaves constants
and columns into one list with slice assignments and joins it: no Python
runs per line. The bytes are exactly what orjson gives for the line's dict
(collector/delivery/line_bodies.py `format_lines_one_by_one` builds those dicts;
tests/test_results_templates.py pins the two against each other).

| form (`form_of`) | lines it renders |
|------------------|------------------|
| `completion`     | /v1/completions results, kind TOKENS (no logprobs) |
| `chat`           | /v1/chat/completions results, kind TOKENS (no logprobs) |
| `embedding`      | /v1/embeddings results, floats as JSON numbers |
| `base64`         | /v1/embeddings results with `encoding_format: "base64"` |

Other results (/v1/responses, logprobs) are rendered one by one.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Sequence

import numpy as np
import orjson

from ingest.catalog import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from pipeline.core.ragged import ranges

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
Piece = bytes | list  # a constant, or one value per line

FORMS = ("completion", "chat", "embedding", "base64")


def form_of(endpoint: str, shape: dict, scored: bool) -> str | None:
    """The template a result of this endpoint and shape is rendered with (None: one by one)."""
    if endpoint == EMBEDDINGS:
        return "base64" if shape.get("encoding_format") == "base64" else "embedding"
    if scored:
        return None
    return {COMPLETIONS: "completion", CHAT_COMPLETIONS: "chat"}.get(endpoint)


def fill(pieces: Sequence[Piece], n: int) -> bytes:
    """n lines, each the concatenation of `pieces`: a constant, or a column (line i takes its
    i-th entry). Adjacent constants are merged first."""
    merged: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, bytes) and not piece:
            continue
        if isinstance(piece, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += piece
        else:
            merged.append(piece)
    k = len(merged)
    flat: list = [None] * (n * k)
    for at, piece in enumerate(merged):
        flat[at::k] = [piece] * n if isinstance(piece, bytes) else piece
    return b"".join(flat)


def fixed(parts: Sequence[bytes | np.ndarray], n: int) -> list[bytes]:
    """One column from constants and [n, w] u1 arrays (each line's w bytes), all side by side:
    a fixed-width matrix filled by numpy, so the join sees one piece where it saw many."""
    widths = [len(p) if isinstance(p, bytes) else p.shape[1] for p in parts]
    matrix = np.empty((n, sum(widths)), dtype=np.uint8)
    at = 0
    for part, width in zip(parts, widths, strict=True):
        matrix[:, at : at + width] = (
            np.frombuffer(part, np.uint8) if isinstance(part, bytes) else part
        )
        at += width
    return matrix.view(f"S{at}").reshape(-1).tolist()  # never ends in NUL: nothing is cut


def choice(which: np.ndarray, yes: bytes, no: bytes) -> Piece:
    """`yes` where `which` holds, else `no`: one constant when every line takes the same, else
    a column of the two objects (no bytes made per line)."""
    if which.all():
        return yes
    if not which.any():
        return no
    return np.array([no, yes], dtype=object)[which.astype(np.intp)].tolist()


def per_value(values: np.ndarray, render: Callable[[int], bytes]) -> list[bytes]:
    """render(v) for each of `values` (int64), called once per distinct value (a page holds
    few: prompt lengths, token counts)."""
    distinct, where = np.unique(values, return_inverse=True)
    texts = np.empty(len(distinct), dtype=object)
    texts[:] = [render(v) for v in distinct.tolist()]
    return texts[where.reshape(-1)].tolist()


def custom_id_column(custom_ids: Sequence[str | None]) -> tuple[list[bytes], bool]:
    """(each custom_id as JSON, whether the quotes around them are left out). One orjson call
    for the page, split at `","`, when no custom_id is null or holds a quote (then every `"`
    in the array is one of its own); else one call per custom_id, quotes included."""
    if None not in custom_ids:
        text = orjson.dumps(custom_ids)
        if b'\\"' not in text:
            return text[2:-2].split(b'","'), True
    return list(map(orjson.dumps, custom_ids)), False


def json_rows(words: np.ndarray, starts: np.ndarray, counts: np.ndarray, dtype: str) -> list:
    """Each row of `words` (rows at `starts`, `counts` long) as the inside of a JSON array,
    `1,2,3` (no brackets): orjson serialises each group of rows of one length as one 2-D
    array, split at its row boundaries (numbers hold no `]`)."""
    n = len(counts)
    if n and (counts == counts[0]).all() and counts[0]:  # one row length: one block, no column
        count, first = int(counts[0]), int(starts[0])
        if (starts == first + count * np.arange(n)).all():
            block = words[first : first + count * n]
        else:
            block = words[ranges(starts, counts)]
        block = block.view(dtype).reshape(n, count)
        return orjson.dumps(block.astype(dtype[1:], copy=False), option=_NUMPY)[2:-2].split(b"],[")
    column = np.empty(n, dtype=object)
    for count in np.unique(counts).tolist():
        rows = np.flatnonzero(counts == count)
        if count == 0:
            column[rows] = [b""] * len(rows)
            continue
        first = int(starts[rows[0]])
        if (starts[rows] == first + count * np.arange(len(rows))).all():  # back to back: a view
            block = words[first : first + count * len(rows)]
        else:
            block = words[ranges(starts[rows], counts[rows])]
        block = block.view(dtype).reshape(len(rows), count)
        text = orjson.dumps(block.astype(dtype[1:], copy=False), option=_NUMPY)
        column[rows] = text[2:-2].split(b"],[")
    return column.tolist()


def base64_rows(words: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> list[bytes]:
    """Each row's little-endian float32 bytes in base64, as OpenAI sends an embedding."""
    data = words.astype("<u4", copy=False).tobytes()
    b64 = binascii.b2a_base64
    return [
        b64(data[4 * s : 4 * (s + c)], newline=False)
        for s, c in zip(starts.tolist(), counts.tolist(), strict=True)
    ]


def lines(
    form: str,
    *,
    hex_ids: np.ndarray,
    custom_ids: Sequence[str | None],
    words: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    prompts: np.ndarray,
    max_tokens: np.ndarray,
    model: str,
    created: int,
    decode: Callable[[list[int]], str] | None,
) -> bytes:
    """The output lines of results of one `form` (see the table), in order, as one buffer.

    `hex_ids[j]` holds result j's id and request_id (64 hex digits, u1); `words` every
    result's payload as u4 words, result j's `counts[j]` words from `starts[j]`;
    `max_tokens[j]` is its shape's (generated forms only)."""
    n = len(hex_ids)
    ids, request_ids = hex_ids[:, :32], hex_ids[:, 32:]
    cids, bare = custom_id_column(custom_ids)
    quote = b'"' if bare else b""
    model_json = orjson.dumps(model)
    prompts = np.asarray(prompts, dtype=np.int64)
    pieces: list[Piece] = [
        fixed([b'{"id":"batch_req_', ids, b'","custom_id":' + quote], n),
        cids,
    ]
    response = quote + b',"response":{"status_code":200,"request_id":"'
    if form in ("embedding", "base64"):
        opening = b'","body":{"object":"list","data":[{"object":"embedding","index":0,"embedding":'
        if form == "base64":
            opening, value, closing = opening + b'"', base64_rows(words, starts, counts), b'"'
        else:
            opening, value, closing = opening + b"[", json_rows(words, starts, counts, "<f4"), b"]"
        usage = closing + b'}],"model":' + model_json + b',"usage":{"prompt_tokens":'
        pieces += [
            fixed([response, request_ids, opening], n),
            value,
            per_value(
                prompts, lambda p: b'%s%d,"total_tokens":%d}}},"error":null}\n' % (usage, p, p)
            ),
        ]
        return fill(pieces, n)
    chat = form == "chat"
    head = b'","body":{"id":"chatcmpl-' if chat else b'","body":{"id":"cmpl-'
    body = (
        b'","object":"chat.completion","created":'
        if chat
        else b'","object":"text_completion","created":'
    )
    body += b"%d" % created + b',"model":' + model_json + b',"choices":[{"index":0,'
    body += b'"message":{"role":"assistant","content":' if chat else b'"text":'
    after_text = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":"'
    finish = choice(counts >= max_tokens, b'length","token_ids":[', b'stop","token_ids":[')
    if decode is None:
        tail = body + b'""' + after_text
        if isinstance(finish, bytes):  # every line ends alike: in the fixed column too
            tail, finish = tail + finish, b""
        pieces.append(fixed([response, request_ids, head, request_ids, tail], n))
    else:
        words_l = words.tolist()
        spans = zip(starts.tolist(), counts.tolist(), strict=True)
        pieces += [
            fixed([response, request_ids, head, request_ids, body], n),
            [orjson.dumps(decode(words_l[s : s + c])) for s, c in spans],
            after_text,
        ]
    counts = np.asarray(counts, dtype=np.int64)
    usage = b']}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}}'
    usage += b',"error":null}\n'
    pieces += [
        finish,
        json_rows(words, starts, counts, "<u4"),
        per_value(
            (prompts << 32) | counts,
            lambda v: usage % (v >> 32, v & 0xFFFFFFFF, (v >> 32) + (v & 0xFFFFFFFF)),
        ),
    ]
    return fill(pieces, n)
