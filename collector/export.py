"""Result pages -> OpenAI Batch output lines, and the output files that make delivery exactly-once.

The broker sends a results client pages of stored results (`ResultPage`, a
few numpy columns and every item's payload back to back). `format_page`
renders one page into output lines and error lines, each one JSON object and
a newline; `page_keys` gives the key of each line (its custom_id, or its id
when the input line had no readable custom_id). `ResultFile` appends lines to
one output file at most once per key, and `sync()` makes them durable: the
client acknowledges a page to the broker only after both of its files are
synced (invariant 12), and a re-run after a crash rewrites nothing it already
has (invariant 5).

A stored result that cannot be rendered (a status other than 0 or 1, a kind
or payload size its shape does not allow, a shape the table lacks, NaN or
infinite values) becomes an `invalid_result` error line for its item, and
the rest of its page is written; only a page whose columns disagree raises
PageError. Completion refuses such results before it stores them
(collector/result_check.py); this covers data stored before it did.

Payload, by `kind`:

| kind | status | payload                               | rendered as                               |
|------|--------|---------------------------------------|-------------------------------------------|
| 0    | 0      | generated token ids, little-endian u4 | a chat.completion or text_completion line |
| 1    | 0      | embedding, little-endian f4           | an embedding line (shortest f32 decimals) |
| 2    | 1      | UTF-8 `code: message`, or a message   | an error line; code `item_failed` unless the text starts with a bare identifier and ": " |

Line forms (`id` and `request_id` depend only on (job_id, index), so a
re-fetch writes identical bytes; error lines are rendered by
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

U is `{"prompt_tokens": P, "completion_tokens": K, "total_tokens": P + K}`
with K the number of generated tokens; F is "length" when K reaches the
shape's `max_tokens`, else "stop"; T is the job's creation time in seconds;
TEXT is `decode(token_ids)`, or "" without a tokenizer (`token_ids` is always
there, as vLLM gives it, so nothing is lost).

A line's key (`line_key`) is `custom_id:<custom_id>`, or `id:<id>` when its
custom_id is null; the prefixes keep a custom_id that looks like an id from
ever being taken for one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from ingest.catalog import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from ingest.line_errors import LineError
from pipeline.durable import fsync_dir
from pipeline.errors import FabricError

RESULT: Final = 0
ERROR: Final = 1
KIND_TOKENS: Final = 0
KIND_EMBEDDING: Final = 1
KIND_ERROR_TEXT: Final = 2
ITEM_FAILED: Final = "item_failed"
INVALID_RESULT: Final = "invalid_result"  # a stored result that cannot be rendered

_BARE_CODE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DUMPS_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY
_HEX = np.array([f"{b:02x}" for b in range(256)], dtype="U2")
_U64 = np.uint64


class ExportError(FabricError):
    """Results cannot be rendered or written as asked."""


class PageError(ExportError):
    """A result page from the broker is malformed; the message names the job, item and field."""


class ResultFileError(ExportError):
    """An output file cannot be used: not a result file, in use, or unreadable."""


@dataclass(eq=False)
class ResultPage:
    """One page of a job's stored results, as the broker sends it to a results client."""

    index: np.ndarray  # u4: the item's index in the job (line number - 1)
    custom_ids: list[str | None]  # None when the input line had no readable custom_id
    status: np.ndarray  # u1: RESULT or ERROR
    kind: np.ndarray  # u1: KIND_TOKENS, KIND_EMBEDDING or KIND_ERROR_TEXT
    shape: np.ndarray  # u2: the item's shape id (0 = unknown)
    prompt_tokens: np.ndarray  # u4: prompt length in tokens
    payload: np.ndarray  # u1: every item's payload back to back
    offsets: np.ndarray  # i8, n + 1


@dataclass(frozen=True)
class ExportContext:
    """What a page needs from its job: ids, model name, shape table, tokenizer, creation time."""

    job_id: str
    model: str
    shapes: Mapping[int, Mapping[str, Any]]  # shape id -> shape dict ("endpoint", "max_tokens")
    decode: Callable[[list[int]], str] | None = None  # token ids -> text; None gives ""
    created_ns: int = 0  # the job's creation time (job.json created_ns)


def format_page(page: ResultPage, context: ExportContext) -> tuple[list[bytes], list[bytes]]:
    """Render `page` as (output lines, error lines), in page order; raise PageError if its
    columns disagree. A stored result that cannot be rendered becomes an error line."""
    checked = _check_page(page, context)
    index = page.index.tolist()
    out_lines = _format_results(page, context, checked)
    err_lines = []
    offsets = page.offsets.tolist()
    payload = memoryview(np.ascontiguousarray(page.payload, dtype=np.uint8))
    for i in checked.errors.tolist():
        code, message = _split_error(bytes(payload[offsets[i] : offsets[i + 1]]))
        error = LineError(index[i] + 1, page.custom_ids[i], code, message)
        err_lines.append(error.to_batch_error_line(context.job_id))
    for i, what in checked.invalid.items():
        message = f"the stored result {what}; it cannot be delivered (report it with the job id)"
        error = LineError(index[i] + 1, page.custom_ids[i], INVALID_RESULT, message)
        err_lines.append(error.to_batch_error_line(context.job_id))
    return out_lines, err_lines


def page_keys(page: ResultPage, context: ExportContext) -> tuple[list[str], list[str]]:
    """The keys of `format_page`'s (output lines, error lines), in the same order."""
    checked = _check_page(page, context)
    results = checked.results
    custom_ids = page.custom_ids
    index = page.index.tolist()
    unnamed = [i for i in results.tolist() if custom_ids[i] is None]
    line_ids = dict(zip(unnamed, _request_ids(context.job_id, page.index[unnamed])[0], strict=True))
    out = [
        line_key(custom_ids[i], f"batch_req_{line_ids[i]}" if i in line_ids else "")
        for i in results.tolist()
    ]
    failed = [*checked.errors.tolist(), *checked.invalid]
    err = [line_key(custom_ids[i], f"{context.job_id}-line-{index[i] + 1}") for i in failed]
    return out, err


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


def _format_results(page: ResultPage, context: ExportContext, checked: _Checked) -> list[bytes]:
    """Output lines for the checked results: columns converted once, then one dict per item."""
    results = checked.results
    if not len(results):
        return []
    kind = page.kind[results]
    endpoints = checked.endpoints
    offsets = np.asarray(page.offsets, dtype=np.int64)
    starts = offsets[results]
    counts = (offsets[results + 1] - starts) // 4
    words, word_starts = _result_words(page.payload, starts, counts)
    floats = words.view("<f4").astype(np.float32, copy=False)  # native order for orjson
    embeds = kind == KIND_EMBEDDING
    if embeds.any():  # gather the token ids alone, so tolist() converts no embedding
        token_counts = np.where(embeds, 0, counts)
        token_starts = np.cumsum(token_counts) - token_counts
        tokens = words[_concat_ranges(word_starts, token_counts)].tolist()
    else:
        token_starts, tokens = word_starts, words.tolist()
    ids, request_ids = _request_ids(context.job_id, page.index[results])
    created = context.created_ns // 1_000_000_000
    model, decode, custom_ids = context.model, context.decode, page.custom_ids
    prompts, counts_l = page.prompt_tokens[results].tolist(), counts.tolist()
    float_at, token_at = word_starts.tolist(), token_starts.tolist()
    lines = []
    for j, i in enumerate(results.tolist()):
        endpoint, max_tokens = endpoints[j]
        count, prompt = counts_l[j], prompts[j]
        if endpoint == EMBEDDINGS:
            start = float_at[j]
            body = _embedding_body(floats[start : start + count], model, prompt)
        else:
            start = token_at[j]
            token_ids = tokens[start : start + count]
            text = decode(token_ids) if decode is not None else ""
            finish = "length" if count >= max_tokens else "stop"
            body = _generated_body(
                endpoint, request_ids[j], created, model, text, token_ids, finish, prompt
            )
        line = {
            "id": "batch_req_" + ids[j],
            "custom_id": custom_ids[i],
            "response": {"status_code": 200, "request_id": request_ids[j], "body": body},
            "error": None,
        }
        lines.append(orjson.dumps(line, option=_DUMPS_OPTIONS))
    return lines


def _embedding_body(embedding: np.ndarray, model: str, prompt: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


def _generated_body(
    endpoint: str,
    request_id: str,
    created: int,
    model: str,
    text: str,
    token_ids: list[int],
    finish: str,
    prompt: int,
) -> dict[str, Any]:
    chat = endpoint == CHAT_COMPLETIONS
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    choice["token_ids"] = token_ids
    completion = len(token_ids)
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


@dataclass(eq=False)
class _Checked:
    """A page sorted out: the positions of results to render (and their (endpoint, max_tokens)),
    of stored errors, and of stored results that cannot be rendered (position -> why)."""

    results: np.ndarray
    endpoints: list[tuple[str, int]]
    errors: np.ndarray
    invalid: dict[int, str]


def _check_page(page: ResultPage, context: ExportContext) -> _Checked:
    """Sort the page's entries; raise PageError if its columns disagree (nothing is usable).

    Belt and braces: completion checks every result before it stores it
    (collector/result_check.py), but a page read from older data may still
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
    offsets = np.asarray(page.offsets, dtype=np.int64)
    if n and (offsets[0] < 0 or offsets[-1] > len(page.payload) or (np.diff(offsets) < 0).any()):
        raise PageError(
            f"job {job_id}: result page offsets run from {int(offsets[0])} to "
            f"{int(offsets[-1])} (or go backwards) over a {len(page.payload)}-byte payload; "
            "the broker sent a malformed page, report it with the job id"
        )
    invalid: dict[int, str] = {}
    status, kind = page.status, page.kind
    sizes = np.diff(offsets)
    results = status == RESULT
    errors = status == ERROR
    for i in np.flatnonzero(~results & ~errors).tolist():
        invalid[i] = f"has status {int(status[i])}, not {RESULT} or {ERROR}"
    for i in np.flatnonzero(results & (sizes % 4 != 0)).tolist():
        invalid[i] = f"has a {int(sizes[i])}-byte payload, not a whole number of u4/f4 values"
    endpoints = _endpoints(context, page.shape, kind, results, invalid)
    embeds = np.flatnonzero(results & (kind == KIND_EMBEDDING))
    embeds = embeds[[i not in invalid for i in embeds.tolist()]] if invalid else embeds
    if len(embeds):
        counts = sizes[embeds] // 4
        words, word_starts = _result_words(page.payload, offsets[embeds], counts)
        floats = words[_concat_ranges(word_starts, counts)].view("<f4")
        owner = np.repeat(np.arange(len(embeds)), counts)
        for i in embeds[np.unique(owner[~np.isfinite(floats)])].tolist():
            invalid[i] = "is an embedding with NaN or infinite values"
        for i in embeds[sizes[embeds] == 0].tolist():
            invalid[i] = "is an empty embedding"
    ok = np.flatnonzero(results)
    if invalid:
        ok = ok[[i not in invalid for i in ok.tolist()]]
    shapes = [endpoints[s] for s in page.shape[ok].tolist()]
    return _Checked(ok, shapes, np.flatnonzero(errors), invalid)


def _endpoints(
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
        want = KIND_EMBEDDING if endpoint == EMBEDDINGS else KIND_TOKENS
        problem = ""
        if not shape:
            problem = f"names shape {shape_id}, which the job's shape table does not hold"
        elif endpoint not in (EMBEDDINGS, CHAT_COMPLETIONS, COMPLETIONS):
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
            invalid.setdefault(i, f"{what}, which gives kind {want}")
        table[shape_id] = (endpoint, max_tokens or 0)
    return table


def _result_words(
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
            source = _concat_ranges(starts[mine] // 4, counts[mine])
            words[_concat_ranges(word_starts[mine], counts[mine])] = view[source]
    return words, word_starts


def _concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """np.concatenate([arange(s, s + c) for s, c in zip(starts, counts)]), without the loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts) + np.arange(
        total, dtype=np.int64
    )


def _request_ids(job_id: str, index: np.ndarray) -> tuple[list[str], list[str]]:
    """(id hex, request_id hex) per item: 32 hex digits each, fixed by (job_id, index).

    Four splitmix64 finalisers of the index, keyed by a blake2b digest of the
    job id; each is a bijection of the index, so ids never repeat inside a job.
    """
    keys = np.frombuffer(hashlib.blake2b(job_id.encode(), digest_size=32).digest(), dtype="<u8")
    x = np.asarray(index, dtype=_U64)[:, None] + keys.astype(_U64)[None, :]
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    x = x ^ (x >> _U64(31))
    digits = _HEX[x.astype(">u8").view(np.uint8).reshape(len(x), 32)]
    text = np.ascontiguousarray(digits).view("U64").ravel().tolist()
    return [t[:32] for t in text], [t[32:] for t in text]


def _split_error(payload: bytes) -> tuple[str, str]:
    text = payload.decode("utf-8", errors="replace")
    code, sep, message = text.partition(": ")
    if sep and _BARE_CODE.fullmatch(code):
        return code, message
    return ITEM_FAILED, text or "the item failed and its worker gave no reason"


def _where(job_id: str, item: int, what: str, fix: str = "") -> str:
    fix = fix or "the broker sent a malformed result page: report it with the job id"
    return f"job {job_id}: item {item} (line {item + 1}) {what}; {fix}"


class ResultFile:
    """One JSONL output file that holds each key at most once, across crashes and re-runs.

    Contract: `open` cuts a torn last line (bytes after the last newline, from
    a writer killed mid-write) and loads the key of every line already there;
    `write` appends only lines whose key is new (also within one call), with
    no buffering of its own; `sync` returns only once everything written is on
    disk, and is the only point after which a page may be acknowledged. A
    failed write or sync leaves the file unusable until it is opened again
    (which cuts what a failed write tore). One process at a time holds a file
    (an exclusive lock), so two clients never append to one path.
    """

    def __init__(self, path: Path, fd: int, keys: set[str], cut_bytes: int) -> None:
        """Use `ResultFile.open`."""
        self.path = path
        self.cut_bytes = cut_bytes  # bytes of a torn last line cut at open (0 if none)
        self._fd = fd
        self._keys = keys
        self._failed: str | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ResultFile:
        """Open or create `path`; raise ResultFileError if it is not a result file or is in use."""
        path = Path(path)
        created = not path.exists()
        try:
            # O_NONBLOCK: a FIFO without a reader fails here instead of hanging; no effect on files
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise ResultFileError(f"cannot open output file {path}: {exc.strerror}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ResultFileError(
                    f"output path {path} is not a regular file; choose a file path"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultFileError(
                    f"output file {path} is in use by another process; wait for it to end "
                    "or write to another path"
                ) from None
            with open(path, "rb") as reader:
                keys, good_bytes, size = _read_keys(path, reader)
            if good_bytes < size:
                os.ftruncate(fd, good_bytes)
                os.fsync(fd)
            if created:
                fsync_dir(path.parent)
        except OSError as exc:
            os.close(fd)
            raise ResultFileError(f"cannot read output file {path}: {exc.strerror}") from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, keys, size - good_bytes)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def write(self, lines: Sequence[bytes], keys: Sequence[str]) -> int:
        """Append the lines whose key is not yet in the file; return how many were appended.

        Each line is one JSON object ending in a newline; `keys[i]` is
        `line_key` of `lines[i]` (from `page_keys`).
        """
        self._check_usable()
        if len(lines) != len(keys):
            raise ValueError(f"write got {len(lines)} lines but {len(keys)} keys")
        new_keys: dict[
            str, None
        ] = {}  # insertion-ordered, so a key repeated in `lines` counts once
        new_lines = []
        for line, key in zip(lines, keys, strict=True):
            if key not in self._keys and key not in new_keys:
                if not line.endswith(b"\n"):
                    raise ValueError(f"line for key {key!r} does not end with a newline")
                new_keys[key] = None
                new_lines.append(line)
        if new_lines:
            data = memoryview(b"".join(new_lines))
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError as exc:
                self._failed = f"a write failed ({exc.strerror})"
                raise ResultFileError(
                    f"writing output file {self.path} failed: {exc.strerror}; free the space "
                    "or fix the disk, then run again (the torn end is cut when it is reopened)"
                ) from exc
            self._keys.update(new_keys)
        return len(new_lines)

    def sync(self) -> None:
        """fsync: everything written so far is on disk when this returns."""
        self._check_usable()
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._failed = f"an fsync failed ({exc.strerror})"
            raise ResultFileError(
                f"syncing output file {self.path} failed: {exc.strerror}; what was written "
                "since the last sync may be lost: run again, and the file is re-read"
            ) from exc

    def close(self) -> None:
        """Close the file (without a sync: call `sync` first to keep what was written)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise ResultFileError(f"output file {self.path} is closed")
        if self._failed is not None:
            raise ResultFileError(
                f"output file {self.path} is unusable after {self._failed}; open it again"
            )

    def __enter__(self) -> ResultFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_keys(path: Path, file: Any) -> tuple[set[str], int, int]:
    """(keys, bytes of whole lines, file size); raise ResultFileError at the first bad line."""
    keys: set[str] = set()
    good_bytes = 0
    file.seek(0)
    for number, line in enumerate(file, 1):
        if not line.endswith(b"\n"):  # torn: the writer died before the newline
            return keys, good_bytes, good_bytes + len(line)
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise _not_ours(path, number, f"not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise _not_ours(path, number, f"a JSON {type(record).__name__}, not an object")
        if "custom_id" not in record:
            raise _not_ours(path, number, "an object without a custom_id field")
        custom_id, line_id = record["custom_id"], record.get("id")
        if custom_id is not None and not isinstance(custom_id, str):
            raise _not_ours(path, number, f"custom_id is {custom_id!r}, not a string or null")
        if not isinstance(line_id, str):
            raise _not_ours(path, number, f"id is {line_id!r}, not a string")
        keys.add(line_key(custom_id, line_id))
        good_bytes += len(line)
    return keys, good_bytes, good_bytes


def _not_ours(path: Path, number: int, what: str) -> ResultFileError:
    return ResultFileError(
        f"{path}: line {number} is {what}; it is not an OpenAI Batch result file this client "
        "wrote, so it is left as it is: move it away or choose another output path"
    )
