"""Delivery pages: FETCH -> RESULT_PAGE, each page marked delivered once the client acks it.

A client fetches a page, writes and fsyncs it, and acknowledges it with its
next FETCH (`ack`); only then are those results marked delivered (invariant
12). One page per job is outstanding, whoever asked: a FETCH without the
matching ack means the client lost the page, which is sent again (the
client's output files drop what they already hold, so a custom_id is written
once). `all: true` reads every stored result from the client's `cursors` and
never marks anything delivered.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import orjson

from collector.completion.results_log import CompletionLog
from collector.job_view import JobView
from router.intern_table import InternTable

MAX_PAGE_ITEMS = 65536
# A page's custom_ids travel in its metadata (pipeline/wire: at most 1 MiB with the job's
# counters, model names and shapes): 4,096 ids of 512 characters do not fit, so such a page is
# halved until its ids take at most this many bytes of JSON.
CUSTOM_ID_BYTES = 512 * 1024


class PageDelivery:
    """The outstanding page of each job, and the pages it answers FETCH with."""

    def __init__(self, completion_log: CompletionLog, shapes: InternTable, page_items: int) -> None:
        self.completion_log = completion_log
        self.shapes = shapes
        self.page_items = page_items  # a FETCH without `limit` gets this many at most
        self.pages: dict[str, tuple[int, list]] = {}  # job -> (page id, where) awaiting its ack
        self.next_page = 1
        self.delivered = 0  # results marked delivered (metrics)

    def refusal(self, view: JobView, meta: dict) -> str | None:
        """Why this FETCH is refused, or None: a vector job's results go to its store."""
        if view.deliver == "file" or meta.get("all", False) or meta.get("sink") == "vectors":
            return None
        return (
            f"job {view.job_id} delivers its results to the vector store ({view.deliver}); "
            f"read them with `results {view.job_id} --all` (until retention ends) or "
            "`python run.py vectors search/export`"
        )

    def outstanding(self, job_id: str) -> bool:
        return job_id in self.pages

    def acknowledge(self, job_id: str, meta: dict) -> None:
        """Mark the job's outstanding page delivered if this FETCH acks it (and forget it
        either way). DiskFullError: marked in memory, made durable by a later sync."""
        outstanding = self.pages.pop(job_id, None)
        if outstanding is not None and meta.get("ack") == outstanding[0]:
            self.delivered += self.completion_log.delivered(job_id, outstanding[1])

    def page(self, view: JobView, meta: dict, info: Callable[[], dict]) -> tuple[dict, dict]:
        """The RESULT_PAGE (meta, arrays) answering this FETCH, headed by `info()`, the job's
        JOB_INFO as it is once the page is read."""
        job_id = view.job_id
        everything = bool(meta.get("all", False))
        limit = max(1, min(int(meta.get("limit", self.page_items)), MAX_PAGE_ITEMS))
        cursors = (  # a negative cursor would count from a segment's end
            {int(s): max(0, int(k)) for s, k in meta.get("cursors", [])} if everything else None
        )
        page = self.completion_log.page(job_id, limit, cursors, everything, view.known)
        custom_ids = view.custom_ids(page.index.tolist())
        while len(page) > 1 and len(orjson.dumps(custom_ids)) > CUSTOM_ID_BYTES:
            limit = max(1, len(page) // 2)  # long custom_ids: a smaller page fits a message
            page = self.completion_log.page(job_id, limit, cursors, everything, view.known)
            custom_ids = view.custom_ids(page.index.tolist())
        page_id = 0
        if len(page) and not everything:
            page_id = self.next_page
            self.next_page += 1
            self.pages[job_id] = (page_id, page.where)
        models = self.completion_log.models
        names = {
            str(m): (models.get(m) or {}).get("model", "") for m in np.unique(page.model).tolist()
        }
        shapes = {str(s): self.shapes.get(s) or {} for s in np.unique(page.shape).tolist()}
        reply = {
            **info(),
            "page": page_id,
            "custom_ids": custom_ids,
            "models": names,
            "shapes": shapes,
            "cursors": [[s, k] for s, k in page.next.items()],
            "req": meta.get("req", 0),  # echoed: a sink tells a stale answer from the current one
        }
        arrays = {
            "index": page.index,
            "status": page.status,
            "kind": page.kind,
            "model": page.model,
            "shape": page.shape,
            "prompt_tokens": page.prompt_tokens,
            "payload": page.payload,
            "offsets": page.offsets,
        }
        if page.part is not None:  # fan-out lines: `index` is the line's, `part` each row's
            arrays["part"] = page.part
            if meta.get("sink") == "vectors":  # a vector's id is its own item's seq
                arrays["item"] = page.item
        return reply, arrays
