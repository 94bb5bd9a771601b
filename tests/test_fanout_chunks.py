"""A new job of list lines is chunked by items: about `ingest.chunk_items` parts a chunk.

ingest/chunk_size.py: a chunk is a number of lines, and none of it reaches
the workers before all of it is logged, so lines of 64 parts in chunks of
`chunk_items` lines made one chunk of a whole small job.
"""

from __future__ import annotations

import io

import orjson
import test_fanout
from test_dispatch_pipeline import job_info
from test_fanout import embed, line, run_job, write

from ingest.chunk_size import lines_per_chunk, parts_of
from pipeline.store.job_files import JobFiles

broker = test_fanout.broker  # the fixture: a broker with the echo model `gen`


def test_lines_per_chunk_follows_the_first_lines_parts(tmp_path):
    def first(record) -> object:
        return write(tmp_path / "in.jsonl", [record])

    assert lines_per_chunk(first(embed("a", input=["x"] * 64)), 512) == 8
    assert lines_per_chunk(first(embed("a", input=[[1, 2]] * 3)), 512) == 170
    assert lines_per_chunk(first(embed("a", input=[1, 2, 3])), 512) == 512  # one prompt of ids
    chat = line("c", "/v1/chat/completions", model="gen", messages=[], n=4)
    assert lines_per_chunk(first(chat), 512) == 128
    assert lines_per_chunk(first(embed("a", input=["x"] * 2048)), 512) == 1
    assert lines_per_chunk(first(embed("a", input="x")), 512) == 512
    (tmp_path / "bad.jsonl").write_bytes(b"\n{not json\n")
    assert lines_per_chunk(tmp_path / "bad.jsonl", 512) == 512
    assert lines_per_chunk(io.BytesIO(orjson.dumps(embed("a", input=["x"] * 64))), 512) == 512
    assert parts_of(["not", "a", "request"]) == 1


def test_a_list_job_is_sent_in_chunks_of_about_chunk_items_parts(tmp_path, broker):
    b = broker(chunk_items=200)
    lines = [embed(f"l{i}", input=[[i + 1, 2]] * 50) for i in range(10)]
    run_job(b, tmp_path, "lists", lines)
    assert JobFiles(b.data_dir.root).read_record("lists")["chunk_lines"] == 4  # 200 // 50
    info = job_info(b, "lists")
    assert (info["total"], info["completed"], info["failed"]) == (10, 10, 0)
    assert b.stop() == 0, b.stderr
