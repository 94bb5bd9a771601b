"""A batch's validation, with its chunks sent to the broker as they check out.

OpenAI's validation reads every line before the batch runs: a file with a bad
line fails, with every bad line listed. Done as a pass of its own, that was
about a third of an echo batch's time through HTTP (bench/http_api.py), where
`run.py submit` overlaps its parsing with the broker's work. So the driver
checks the lines and sends them in one pass (`check_and_send`, on the driver's
submit thread): each chunk of the broker's own line checks (`iter_batch_input`,
as `run.py submit` runs them) is sent as the batch's job once it and the chunk
after it checked out, and the job's last chunk (the one that completes it) is
sent only after the whole file did.

The first bad line stops the sending (`Held`), and the rest of the file is
still read to list every bad line. Then:

| the batch                       | what the driver does with the job                       |
|---------------------------------|---------------------------------------------------------|
| OpenAI's default (bad lines fail it) | cancels it, then sends it the rest of the file so that it finishes (`cancelled`; `completed` if every line ran before the cancel reached it) and expires like any job; lines sent before the bad one may have run; no output file is made |
| `fabric_accept_partial`, lines of another url | resumes it from a copy of the file with those lines blank (the chunks sent are the same in the copy) |
| `fabric_accept_partial`, other bad lines | nothing: they go in the job, where they become error lines |

A batch cancelled or expired while validating closes its job the same way.
A pass cut off by a kill is simply run again: the job is resumed (chunks
already acknowledged are not sent again) and the lines are checked again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ingest.batch_input import iter_batch_input
from ingest.chunk_size import lines_per_chunk
from ingest.input_chunk import InputChunk
from ingest.submit_client import Producer


class Held(Exception):
    """A bad line (or a stop request) ended the sending before the end of the file."""


@dataclass
class Checked:
    """What validation found in an input file."""

    errors: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's {code, line, ...}
    lines: int = 0  # non-blank lines
    wrong_url: dict[int, str | None] = field(default_factory=dict)  # {line: custom_id}
    sent_all: bool = False  # every chunk is in the job: the job is complete
    job: bool = False  # the job may exist: a chunk was sent (now, or before a restart)

    def add(self, chunk: InputChunk, endpoint: str) -> None:
        """The errors of one chunk, and its lines whose url is not the batch's endpoint."""
        self.lines += len(chunk.custom_ids) + len(chunk.errors)
        self.errors += [error(e.code, e.line, e.message) for e in chunk.errors]
        off = [k for k, shape in enumerate(chunk.shapes) if shape.endpoint != endpoint]
        if not off:
            return
        for item in np.flatnonzero(np.isin(chunk.shape_index, off)).tolist():
            number = int(chunk.line[item])
            url = chunk.shapes[int(chunk.shape_index[item])].endpoint
            self.wrong_url[number] = chunk.custom_ids[item]
            self.errors.append(
                error(
                    "invalid_url",
                    number,
                    f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}; "
                    "every request of a batch uses its endpoint",
                    "url",
                )
            )


def error(code: str, line: int | None, message: str, param: str | None = None) -> dict[str, Any]:
    """One of OpenAI's validation errors."""
    return {"code": code, "line": line, "message": message, "param": param}


def check_and_send(
    producer: Producer,
    path: Path,
    batch_id: str,
    endpoint: str,
    *,
    accept_partial: bool,
    deadline: float | None,
    stop: threading.Event,
    job_priority: int = 0,
    limits: dict[str, Any] | None = None,
    reuse: bool = False,
) -> Checked:
    """Check every line of `path` and send the lines as job `batch_id` while none is bad (with
    `accept_partial`, while no line is for another url; `job_priority`: the job's, from the
    metadata); see the module docstring. `stop` set (the batch was cancelled or expired
    meanwhile) ends the sending too. `limits`: the job's caps (api/batch_limits.py); `reuse`:
    its lines take stored results (api/batch_reuse.py)."""
    status = producer.job_status(batch_id)
    chunk_items = int(producer.catalog()["chunk_items"])
    lines = int(status["chunk_lines"]) if status["exists"] else lines_per_chunk(path, chunk_items)
    checked = Checked(job=bool(status["exists"]))
    source = iter_batch_input(path, producer.settings(lines), chunk_lines=lines)

    def good_chunks() -> Iterator[InputChunk]:
        first = True
        for chunk in source:
            checked.add(chunk, endpoint)
            bad = checked.wrong_url or (checked.errors and not accept_partial)
            if bad or stop.is_set():
                raise Held
            # the submit client sends a chunk once it holds the next (to mark the last one):
            # taking this one sends the one before
            checked.job = checked.job or not first
            first = False
            yield chunk

    try:
        producer.submit_file(
            str(path),
            batch_id,
            chunk_lines=lines,
            parsed=(lines, good_chunks()),
            deadline=deadline,
            job_priority=job_priority,
            limits=limits,
            reuse=reuse,
        )
        checked.sent_all = True
    except Held:
        if not stop.is_set():
            for chunk in source:  # the rest of the file, to list every bad line
                checked.add(chunk, endpoint)
    checked.errors.sort(key=lambda e: e["line"] or 0)
    return checked
