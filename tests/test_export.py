"""Result pages rendered as OpenAI Batch lines, and output files that hold each key once.

The last tests run a real writer process: one is SIGKILLed at random points
four times, one dies mid-line at a file size limit; each time the files are
reopened and the export finished, and every key ends up exactly once and
every line parses. This module is also that writer:
`python tests/test_export.py OUT ERR FILE_BYTES` (0 = no size limit).
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import orjson
import pytest
from conftest import wait_for

from collector.delivery.lines import format_page, line_key, page_keys
from collector.delivery.result_file import ResultFile, ResultFileError
from collector.delivery.result_page import ExportContext, PageError, ResultPage
from pipeline.core.errors import FabricError

EMBED, CHAT, COMPLETE = 1, 2, 3
SHAPES = {
    EMBED: {"endpoint": "/v1/embeddings", "max_tokens": None},
    CHAT: {"endpoint": "/v1/chat/completions", "max_tokens": 4},
    COMPLETE: {"endpoint": "/v1/completions", "max_tokens": 8},
}
CREATED_NS = 1_700_000_123_456_789_000


def tokens(*ids: int) -> tuple[int, bytes]:
    return 0, np.array(ids, dtype="<u4").tobytes()


def floats(*values: float) -> tuple[int, bytes]:
    return 1, np.array(values, dtype="<f4").tobytes()


def failure(text: bytes) -> tuple[int, bytes]:
    return 2, text


def make_page(items: list[tuple]) -> ResultPage:
    """items: (index, custom_id, shape, prompt_tokens, (kind, payload)) per item."""
    payloads = [payload for *_, (_, payload) in items]
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in payloads])
    kind = np.array([k for *_, (k, _) in items], dtype=np.uint8)
    return ResultPage(
        index=np.array([item[0] for item in items], dtype=np.uint32),
        custom_ids=[item[1] for item in items],
        status=(kind == 2).astype(np.uint8),
        kind=kind,
        shape=np.array([item[2] for item in items], dtype=np.uint16),
        prompt_tokens=np.array([item[3] for item in items], dtype=np.uint32),
        payload=np.frombuffer(b"".join(payloads), dtype=np.uint8),
        offsets=offsets,
    )


def context(decode=None, job_id: str = "job-7") -> ExportContext:
    return ExportContext(job_id, "tiny-model", SHAPES, decode=decode, created_ns=CREATED_NS)


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def parse(lines: list[bytes]) -> list[dict]:
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
    return [orjson.loads(line) for line in lines]


# Formatting


def test_embedding_line():
    page = make_page([(3, "e-1", EMBED, 5, floats(0.5, -0.25, 0.1))])
    out, err = format_page(page, context())
    [line] = parse(out)
    assert err == []
    assert line["custom_id"] == "e-1"
    assert line["id"].startswith("batch_req_") and len(line["id"]) == len("batch_req_") + 32
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and len(response["request_id"]) == 32
    assert response["body"] == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25, 0.1]}],
        "model": "tiny-model",
        "usage": {"prompt_tokens": 5, "total_tokens": 5},
    }
    assert b"[0.5,-0.25,0.1]" in out[0]  # float32 written shortest, not as a widened double


def test_chat_line_with_decode():
    page = make_page([(0, "c-1", CHAT, 11, tokens(5, 6, 7))])
    [line] = parse(format_page(page, context(decode=words))[0])
    body = line["response"]["body"]
    assert body["id"] == "chatcmpl-" + line["response"]["request_id"]
    assert body["object"] == "chat.completion"
    assert body["created"] == CREATED_NS // 1_000_000_000
    assert body["model"] == "tiny-model"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "w5 w6 w7"},
            "logprobs": None,
            "finish_reason": "stop",
            "token_ids": [5, 6, 7],
        }
    ]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


def test_completion_line_and_finish_reason():
    page = make_page(
        [
            (0, "full", COMPLETE, 2, tokens(*range(8))),  # reached max_tokens 8
            (1, "short", COMPLETE, 2, tokens(1, 2)),
            (2, "chat-full", CHAT, 1, tokens(1, 2, 3, 4)),  # reached max_tokens 4
        ]
    )
    lines = parse(format_page(page, context(decode=words))[0])
    bodies = [line["response"]["body"] for line in lines]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == ["length", "stop", "length"]
    body = bodies[1]
    assert body["id"] == "cmpl-" + lines[1]["response"]["request_id"]
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "w1 w2"
    assert body["choices"][0]["token_ids"] == [1, 2]
    assert "message" not in body["choices"][0]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert bodies[0]["usage"]["completion_tokens"] == 8


def test_without_tokenizer_text_is_empty_and_token_ids_remain():
    page = make_page([(0, "a", CHAT, 3, tokens(9, 8)), (1, "b", COMPLETE, 3, tokens(7))])
    chat, completion = parse(format_page(page, context(decode=None))[0])
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == ""
    assert chat["response"]["body"]["choices"][0]["token_ids"] == [9, 8]
    assert completion["response"]["body"]["choices"][0]["text"] == ""
    assert completion["response"]["body"]["choices"][0]["token_ids"] == [7]


def test_model_decoders_decode_with_each_models_tokenizer_where_its_file_is_here(tmp_path):
    """The one home of every door's decoders: a model with its tokenizer file here decodes
    its token ids; a model without a tokenizer, or whose file is not on this host, has none."""
    from broker import WORDS, build_tokenizer

    from collector.delivery.decoders import model_decoders
    from config import load_settings

    tokenizer = build_tokenizer(tmp_path / "tokenizer.json")
    models = [
        {"name": "texty", "engine": "echo", "tokenizer": str(tokenizer), "max_tokens": 64},
        {"name": "ids", "engine": "echo"},
        {"name": "elsewhere", "engine": "echo", "tokenizer": str(tmp_path / "gone.json")},
    ]
    settings = load_settings(None, {"broker": {"data_dir": tmp_path}, "models": models})
    decoders = model_decoders(settings)
    assert set(decoders) == {"texty"}
    assert decoders["texty"]([1, 2, 3]) == " ".join(WORDS[:3])


def test_error_lines_with_and_without_custom_id():
    page = make_page(
        [
            (0, "ok", CHAT, 1, tokens(1)),
            (1, "bad", 0, 0, failure(b"token_out_of_range: token 99999 is past the vocabulary")),
            (2, None, 0, 0, failure(b"line 3: missing_field: no custom_id")),
            (3, "plain", CHAT, 0, failure(b"the engine gave up")),
            (4, "empty", CHAT, 0, failure(b"")),
        ]
    )
    out, err = format_page(page, context())
    assert [line["custom_id"] for line in parse(out)] == ["ok"]
    assert parse(err) == [
        {
            "id": "job-7-line-2",
            "custom_id": "bad",
            "response": None,
            "error": {
                "code": "token_out_of_range",
                "message": "token 99999 is past the vocabulary",
            },
        },
        {
            "id": "job-7-line-3",
            "custom_id": None,
            "response": None,
            "error": {"code": "item_failed", "message": "line 3: missing_field: no custom_id"},
        },
        {
            "id": "job-7-line-4",
            "custom_id": "plain",
            "response": None,
            "error": {"code": "item_failed", "message": "the engine gave up"},
        },
        {
            "id": "job-7-line-5",
            "custom_id": "empty",
            "response": None,
            "error": {
                "code": "item_failed",
                "message": "the item failed and its worker gave no reason",
            },
        },
    ]


def test_mixed_page_with_unaligned_payloads():
    """Error text between results leaves payloads off 4-byte boundaries; values survive."""
    page = make_page(
        [
            (0, "a", CHAT, 1, tokens(1, 2)),
            (1, "x", 0, 0, failure(b"odd: 3")),  # 6 bytes: what follows starts at phase 2
            (2, "b", EMBED, 4, floats(1.5, 2.5)),
            (3, "y", 0, 0, failure(b"y")),  # phase 3
            (4, "c", COMPLETE, 1, tokens(4_000_000_000, 3)),
            (5, "d", EMBED, 4, floats(-1.0)),
        ]
    )
    out, err = format_page(page, context())
    bodies = {line["custom_id"]: line["response"]["body"] for line in parse(out)}
    assert bodies["a"]["choices"][0]["token_ids"] == [1, 2]
    assert bodies["b"]["data"][0]["embedding"] == [1.5, 2.5]
    assert bodies["c"]["choices"][0]["token_ids"] == [4_000_000_000, 3]
    assert bodies["d"]["data"][0]["embedding"] == [-1.0]
    assert [e["error"]["code"] for e in parse(err)] == ["odd", "item_failed"]


def test_ids_are_stable_per_job_and_index():
    items = [(i, f"r-{i}", CHAT, 1, tokens(i)) for i in range(50)]
    first = format_page(make_page(items), context())
    again = format_page(make_page(items), context())
    assert first == again
    # a re-fetch in other pages gives the same line per item
    split = (
        format_page(make_page(items[25:]), context())[0]
        + format_page(make_page(items[:25]), context())[0]
    )
    assert sorted(split) == sorted(first[0])
    lines = parse(first[0])
    assert len({line["id"] for line in lines}) == 50
    assert len({line["response"]["request_id"] for line in lines}) == 50
    other = parse(format_page(make_page(items), context(job_id="job-8"))[0])
    assert not {line["id"] for line in lines} & {line["id"] for line in other}


def test_page_keys_follow_the_lines():
    page = make_page(
        [
            (0, "a", CHAT, 1, tokens(1)),
            (1, None, CHAT, 1, tokens(2)),
            (2, None, 0, 0, failure(b"x")),
            (3, "d", 0, 0, failure(b"y")),
        ]
    )
    out, err = format_page(page, context())
    out_keys, err_keys = page_keys(page, context())
    expected = [
        [line_key(line["custom_id"], line["id"]) for line in parse(lines)] for lines in (out, err)
    ]
    assert [out_keys, err_keys] == expected
    assert out_keys[0] == line_key("a", "ignored") != line_key(None, "a")


def _reslice(page, offsets: list[int]) -> None:
    """Cut the page's payload into other rows (the offsets rule: they end at its end)."""
    page.offsets = np.array(offsets, dtype=np.int64)
    page.payload = page.payload[: offsets[-1]]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda p: setattr(p, "offsets", np.array([0, 99], dtype=np.int64)), "99"),
        (lambda p: setattr(p, "custom_ids", []), "custom_ids"),
    ],
)
def test_malformed_page_is_refused(change, named):
    page = make_page([(41, "a", CHAT, 1, tokens(1, 2))])
    change(page)
    with pytest.raises(PageError, match=named) as caught:
        format_page(page, context())
    assert "job-7" in str(caught.value)
    assert isinstance(caught.value, FabricError)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda p: setattr(p, "shape", np.array([99, CHAT, EMBED], dtype=np.uint16)), "shape 99"),
        (lambda p: setattr(p, "kind", np.array([1, 0, 1], dtype=np.uint8)), "kind 1"),
        (lambda p: setattr(p, "status", np.array([3, 0, 0], dtype=np.uint8)), "status 3"),
        (lambda p: _reslice(p, [0, 6, 10, 18]), "6-byte"),
        (lambda p: setattr(p, "shape", np.array([CHAT, CHAT, 0], dtype=np.uint16)), "shape 0"),
    ],
)
def test_a_stored_result_that_cannot_be_rendered_becomes_an_error_line(change, named):
    """Issue 14 point 2 (belt and braces): one bad entry no longer makes the page undeliverable
    (the results command exited 7 on it for ever); the rest of the page is written."""
    page = make_page(
        [
            (41, "a", CHAT, 1, tokens(1, 2)),
            (42, "b", CHAT, 1, tokens(3)),
            (43, "c", EMBED, 1, floats(1, 2)),
        ]
    )
    change(page)
    out, err = format_page(page, context())
    out_keys, err_keys = page_keys(page, context())
    [error] = parse(err)
    assert error["custom_id"] != "b" and error["error"]["code"] == "invalid_result"
    assert named in error["error"]["message"]
    assert "b" in [line["custom_id"] for line in parse(out)]
    assert len(out) + len(err) == 3
    assert err_keys == [line_key(error["custom_id"], error["id"])]
    assert out_keys == [line_key(line["custom_id"], line["id"]) for line in parse(out)]


def test_a_stored_embedding_with_nan_or_inf_becomes_an_error_line():
    """Issue 14 point 11: NaN or infinite values are never written as an embedding."""
    page = make_page(
        [
            (0, "a", EMBED, 1, floats(1.0, float("nan"))),
            (1, "b", EMBED, 1, floats(0.5, 0.25)),
            (2, "c", EMBED, 1, floats(float("inf"), 1.0)),
        ]
    )
    out, err = format_page(page, context())
    assert [line["custom_id"] for line in parse(out)] == ["b"]
    assert [(e["custom_id"], e["error"]["code"]) for e in parse(err)] == [
        ("a", "invalid_result"),
        ("c", "invalid_result"),
    ]
    assert page_keys(page, context())[1] == ["custom_id:a", "custom_id:c"]


def test_a_line_this_client_cannot_render_becomes_its_error_line_and_the_page_is_written():
    """Issue 30 point 2: a line whose rendering raises (here the tokenizer fails on one line's
    token ids, in the templated path) is that line's `invalid_result` error line; the page's
    other lines are written as a page without it gives them, and the keys follow."""

    def decode(ids: list[int]) -> str:
        if 13 in ids:
            raise ValueError("token id 13 is not in the vocabulary")
        return words(ids)

    good = [
        (0, "a", CHAT, 1, tokens(1, 2)),
        (2, "c", EMBED, 1, floats(1, 2)),
        (3, "d", COMPLETE, 1, tokens(4)),
    ]
    page = make_page([*good[:1], (1, "b", COMPLETE, 1, tokens(13, 5)), *good[1:]])
    out, err = format_page(page, context(decode))
    assert out == format_page(make_page(good), context(decode))[0]
    [error] = parse(err)
    assert (error["custom_id"], error["error"]["code"]) == ("b", "invalid_result")
    message = error["error"]["message"]
    assert "ValueError: token id 13 is not in the vocabulary" in message
    assert "report it with the job id" in message
    out_keys, err_keys = page_keys(page, context(decode))
    assert (out_keys, err_keys) == (["custom_id:a", "custom_id:c", "custom_id:d"], ["custom_id:b"])


# Output files


def test_write_dedupes_within_and_across_calls(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultFile.open(path) as file:
        assert file.write([b'{"id":"1","custom_id":"a"}\n'] * 2, ["custom_id:a"] * 2) == 1
        assert file.write([b'{"id":"1","custom_id":"a"}\n'], ["custom_id:a"]) == 0
        file.sync()
    assert path.read_bytes() == b'{"id":"1","custom_id":"a"}\n'


def test_reopen_dedupes_custom_ids_and_ids(tmp_path):
    items = [(i, f"r-{i}" if i % 3 else None, CHAT, 1, tokens(i)) for i in range(30)]
    items += [(30, "bad", 0, 0, failure(b"x")), (31, None, 0, 0, failure(b"y"))]
    page = make_page(items)
    out, err = format_page(page, context())
    out_keys, err_keys = page_keys(page, context())
    paths = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    for path, lines, keys in zip(paths, (out, err), (out_keys, err_keys), strict=True):
        with ResultFile.open(path) as file:
            assert file.write(lines[:10], keys[:10]) == min(10, len(lines))
            file.sync()
        with ResultFile.open(path) as file:
            assert len(file) == min(10, len(lines))
            assert file.write(lines, keys) == max(0, len(lines) - 10)
            file.sync()
        with ResultFile.open(path) as file:
            assert file.write(lines, keys) == 0
        assert sorted(path.read_bytes().splitlines(keepends=True)) == sorted(lines)


def test_torn_last_line_is_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    page = make_page([(i, f"r-{i}", CHAT, 1, tokens(i)) for i in range(4)])
    out, _ = format_page(page, context())
    keys, _ = page_keys(page, context())
    with ResultFile.open(path) as file:
        file.write(out[:2], keys[:2])
        file.sync()
    torn = out[2][: len(out[2]) // 2]
    with path.open("ab") as raw:
        raw.write(torn)
    with ResultFile.open(path) as file:
        assert file.cut_bytes == len(torn)
        assert path.read_bytes() == b"".join(out[:2])
        assert keys[2] not in file and keys[1] in file
        assert file.write(out, keys) == 2
        file.sync()
    assert path.read_bytes() == b"".join(out)


def test_new_file_is_created_and_empty_file_is_fine(tmp_path):
    path = tmp_path / "new.jsonl"
    with ResultFile.open(path) as file:
        assert len(file) == 0 and file.cut_bytes == 0
    assert path.exists() and path.read_bytes() == b""


@pytest.mark.parametrize(
    ("content", "line", "what"),
    [
        (b'{"id":"1","custom_id":"a"}\nnot json at all\n', 2, "not JSON"),
        (b"[1, 2]\n", 1, "not an object"),
        (b'{"id":"1","custom_id":"a"}\n{"id":"2"}\n', 2, "without a custom_id"),
        (b'{"id":"1","custom_id":7}\n', 1, "custom_id is 7"),
        (b'{"custom_id":null}\n', 1, "id is None"),
        (b"\n", 1, "not JSON"),
    ],
)
def test_a_file_that_is_not_ours_is_refused_and_left_alone(tmp_path, content, line, what):
    path = tmp_path / "precious.txt"
    path.write_bytes(content + b"trailing bytes without a newline")
    with pytest.raises(ResultFileError, match=what) as caught:
        ResultFile.open(path)
    assert str(path) in str(caught.value) and f"line {line} " in str(caught.value)
    assert path.read_bytes() == content + b"trailing bytes without a newline"


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultFile.open(path), pytest.raises(ResultFileError, match="in use"):
        ResultFile.open(path)
    ResultFile.open(path).close()  # free again once the first one closed


def test_a_path_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(ResultFileError, match=str(path)):
            ResultFile.open(path)


def test_a_failed_write_keeps_its_keys_out_and_stops_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    file = ResultFile.open(path)
    good_fd = file._fd
    file._fd = os.open(path, os.O_RDONLY)  # every write now fails, as on a broken disk
    try:
        with pytest.raises(ResultFileError, match="writing output file"):
            file.write([b'{"id":"1","custom_id":"a"}\n'], ["custom_id:a"])
        assert "custom_id:a" not in file
        with pytest.raises(ResultFileError, match="unusable"):
            file.sync()
    finally:
        file.close()
        os.close(good_fd)
    with ResultFile.open(path) as file:  # reopened, it goes on
        assert file.write([b'{"id":"1","custom_id":"a"}\n'], ["custom_id:a"]) == 1


def test_write_refuses_mismatched_keys_and_lines_without_newline(tmp_path):
    with ResultFile.open(tmp_path / "out.jsonl") as file:
        with pytest.raises(ValueError, match="2 lines but 1 keys"):
            file.write([b"{}\n", b"{}\n"], ["a"])
        with pytest.raises(ValueError, match="newline"):
            file.write([b'{"id":"1","custom_id":"a"}'], ["custom_id:a"])


# A real writer, SIGKILLed

PAGES = 30
PAGE_ITEMS = 100


def crash_pages() -> list[ResultPage]:
    """The job the writer child exports: chat results, errors, some without custom_id."""
    rng = np.random.default_rng(99)
    pages = []
    for number in range(PAGES):
        items = []
        for i in range(number * PAGE_ITEMS, (number + 1) * PAGE_ITEMS):
            custom_id = None if i % 17 == 0 else f"req-{i}"
            if i % 11 == 0:
                items.append((i, custom_id, CHAT, 3, failure(b"engine_rejected: item %d" % i)))
            else:
                generated = rng.integers(0, 50_000, int(rng.integers(1, 1500)))
                items.append((i, custom_id, CHAT, 3, tokens(*generated.tolist())))
        pages.append(make_page(items))
    return pages


def rendered(pages: list[ResultPage]) -> list[tuple[list[bytes], ...]]:
    """Per page: (output lines, error lines, output keys, error keys), as a client makes them."""
    ctx = context(decode=words)
    return [(*format_page(page, ctx), *page_keys(page, ctx)) for page in pages]


def export(out_path: Path, err_path: Path, pages: list[tuple], on_synced=None) -> None:
    """What a results client does per page: write both files, sync both, then acknowledge."""
    with ResultFile.open(out_path) as out_file, ResultFile.open(err_path) as err_file:
        for number, (out, err, out_keys, err_keys) in enumerate(pages):
            out_file.write(out, out_keys)
            err_file.write(err, err_keys)
            out_file.sync()
            err_file.sync()
            if on_synced is not None:
                on_synced(number)


def child_main(out_path: str, err_path: str, pages_path: str, file_bytes: str) -> None:
    """Read the pages the test rendered (`saved_pages`) first, so a kill lands in writes and
    syncs, then export them.

    A `file_bytes` limit above 0 caps each file's size (RLIMIT_FSIZE): the
    write that crosses it stops mid-line and the child dies of the error.
    """
    if int(file_bytes):
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(file_bytes), int(file_bytes)))
    pages = pickle.loads(Path(pages_path).read_bytes())

    def ack(number: int) -> None:
        sys.stdout.write(f"synced {number}\n")
        sys.stdout.flush()

    export(Path(out_path), Path(err_path), pages, on_synced=ack)


def saved_pages(tmp_path: Path) -> tuple[list[tuple], Path]:
    """The crash job's pages rendered once, and the file the writer children read them from
    (rendering them costs each child about a second of CPU)."""
    pages = rendered(crash_pages())
    path = tmp_path / "pages.pickle"
    path.write_bytes(pickle.dumps(pages))
    return pages, path


class Writer:
    """The writer child; the highest page it acknowledged is read from its stdout."""

    def __init__(self, out_path: Path, err_path: Path, pages: Path, file_bytes: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(out_path), str(err_path), str(pages), str(file_bytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.acked = -1
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("synced ") and line.endswith("\n"):
                self.acked = int(line.split()[1])

    def stop(self, kill: bool) -> int:
        """SIGKILL the child (or wait for it to die); return the highest page it acknowledged."""
        if kill:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=30)
        self.proc.stdout.close()
        return self.acked


def assert_acked_pages_on_disk(out_path: Path, err_path: Path, pages: list, acked: int) -> None:
    """Every page the child acknowledged is in its files (invariant 12)."""
    with ResultFile.open(out_path) as out_file, ResultFile.open(err_path) as err_file:
        for _, _, out_keys, err_keys in pages[: acked + 1]:
            assert all(key in out_file for key in out_keys)
            assert all(key in err_file for key in err_keys)


def assert_exported_once(out_path: Path, err_path: Path, pages: list) -> None:
    """Each key exactly once, every line parses, and the lines are exactly the job's lines."""
    out = [orjson.loads(line) for line in out_path.read_bytes().splitlines()]
    err = [orjson.loads(line) for line in err_path.read_bytes().splitlines()]
    keys = [line_key(line["custom_id"], line["id"]) for line in out + err]
    assert len(keys) == len(set(keys)) == PAGES * PAGE_ITEMS
    named = [line["custom_id"] for line in out + err if line["custom_id"] is not None]
    assert len(named) == len(set(named))
    expected = {line for page_out, page_err, _, _ in pages for line in page_out + page_err}
    written = set(out_path.read_bytes().splitlines(keepends=True))
    written |= set(err_path.read_bytes().splitlines(keepends=True))
    assert written == expected


def test_writer_killed_mid_run_then_finished_writes_each_line_once(tmp_path):
    out_path, err_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    pages, pages_path = saved_pages(tmp_path)
    total_bytes = sum(len(line) for page in pages for line in page[0])
    rng = np.random.default_rng(5)
    for _ in range(4):  # kill at a random point, restart from the files, kill again
        writer = Writer(out_path, err_path, pages_path)
        grown_to = int(rng.integers(1, total_bytes // 3))
        wait_for(
            lambda: out_path.exists() and out_path.stat().st_size > grown_to,  # noqa: B023
            "the writer to grow its output file",
            interval_s=0.001,
        )
        acked = writer.stop(kill=True)
        assert_acked_pages_on_disk(out_path, err_path, pages, acked)
    export(out_path, err_path, pages)
    assert_exported_once(out_path, err_path, pages)


def test_writer_dead_mid_line_leaves_a_torn_line_that_reopen_cuts(tmp_path):
    out_path, err_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    pages, pages_path = saved_pages(tmp_path)
    first_page_bytes = sum(len(line) for line in pages[0][0])
    limit = first_page_bytes + len(pages[1][0][0]) // 2  # half way into page 1's first line
    writer = Writer(out_path, err_path, pages_path, file_bytes=limit)
    assert writer.stop(kill=False) == 0
    assert writer.proc.returncode != 0
    assert out_path.stat().st_size == limit
    with ResultFile.open(out_path) as out_file:
        assert out_file.cut_bytes == limit - first_page_bytes
        assert len(out_file) == len(pages[0][0])
    assert out_path.read_bytes() == b"".join(pages[0][0])
    export(out_path, err_path, pages)
    assert_exported_once(out_path, err_path, pages)


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
