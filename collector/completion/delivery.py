"""Delivery pages: FETCH -> RESULT_PAGE, each page marked delivered once the client acks it.

A client fetches a page, writes and fsyncs it, and acknowledges it with a
later FETCH (`ack`); only then are those results marked delivered (invariant
12). A client may ask for the next page while it still writes one: its FETCH
names the pages it holds (`hold`, received and not yet acknowledged), and the
new page leaves their results out; completion says it understands `hold` with
`ahead: true` in every RESULT_PAGE (an older completion does not, and its
clients ask one page at a time). The pages a job has out (at most
`MAX_OUTSTANDING`) are kept whoever asked: a FETCH that neither acks nor
holds one of them means the client lost it, and it is forgotten, its results
sent again (the client's output files drop what they already hold, so a
custom_id is written once). `all: true` reads every stored result from the
client's `cursors` and never marks anything delivered.

A page names each row's model (`model`, its number in `models.log`, and meta
`models`, number -> the model's own name); when some row's line gave an alias
of it (ingest/model_aliases.py), the page also holds `name` (u2, 0 = the
model's own name, k = meta `names[k - 1]`), and the output's `model` is that
name. A vector sink's page goes without: stores know models by their own names.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import orjson

from collector.completion.results_log import CompletionLog
from collector.job_view import JobView
from pipeline.store.intern_table import InternTable

MAX_PAGE_ITEMS = 65536
MAX_OUTSTANDING = 4  # pages of one job sent and not yet acknowledged (`hold` keeps the newest)
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
        # job -> its pages (page id, where) sent and awaiting their ack, oldest first
        self.pages: dict[str, list[tuple[int, list]]] = {}
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
        """Mark the job's page that this FETCH acks (`ack`) delivered, keep those it holds
        (`hold`), and forget the others. DiskFullError: marked in memory, made durable by a
        later sync."""
        ack, hold = meta.get("ack"), meta.get("hold") or []
        if not isinstance(hold, list) or not all(type(h) is int for h in hold):
            raise ValueError(f"hold is {hold!r}; it must be a list of page ids")
        outstanding = self.pages.pop(job_id, [])
        kept = [(page_id, where) for page_id, where in outstanding if page_id in hold]
        if kept:
            self.pages[job_id] = kept[-(MAX_OUTSTANDING - 1) :]
        for page_id, where in outstanding:
            if page_id == ack:
                self.delivered += self.completion_log.delivered(job_id, where)

    def _held(self, job_id: str) -> dict[int, np.ndarray] | None:
        """Completion segment id -> slots of the job's pages the client holds (left out of
        its next page)."""
        held: dict[int, list[np.ndarray]] = {}
        for _, where in self.pages.get(job_id, ()):
            for segment_id, slots in where:
                held.setdefault(segment_id, []).append(slots)
        return {s: np.concatenate(parts) for s, parts in held.items()} or None

    def page(self, view: JobView, meta: dict, info: Callable[[], dict]) -> tuple[dict, dict]:
        """The RESULT_PAGE (meta, arrays) answering this FETCH, headed by `info()`, the job's
        JOB_INFO as it is once the page is read."""
        job_id = view.job_id
        everything = bool(meta.get("all", False))
        limit = max(1, min(int(meta.get("limit", self.page_items)), MAX_PAGE_ITEMS))
        cursors = (  # a negative cursor would count from a segment's end
            {int(s): max(0, int(k)) for s, k in meta.get("cursors", [])} if everything else None
        )
        skip = None if everything else self._held(job_id)
        page = self.completion_log.page(job_id, limit, cursors, everything, view.known, skip)
        custom_ids = view.custom_ids(page.index)
        while len(page) > 1 and len(orjson.dumps(custom_ids)) > CUSTOM_ID_BYTES:
            limit = max(1, len(page) // 2)  # long custom_ids: a smaller page fits a message
            page = self.completion_log.page(job_id, limit, cursors, everything, view.known, skip)
            custom_ids = view.custom_ids(page.index)
        page_id = 0
        if len(page) and not everything:
            page_id = self.next_page
            self.next_page += 1
            self.pages.setdefault(job_id, []).append((page_id, page.where))
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
            "ahead": True,  # this completion keeps the pages a FETCH holds (`hold`)
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
        given = view.given_names(page.index) if meta.get("sink") != "vectors" else None
        if given is not None:  # some line gave its model an alias: the output repeats it
            reply["names"] = view.names
            arrays["name"] = given.astype(np.uint16)
        if page.part is not None:  # fan-out lines: `index` is the line's, `part` each row's
            arrays["part"] = page.part
            if meta.get("sink") == "vectors":  # a vector's id is its own item's seq
                arrays["item"] = page.item
        return reply, arrays
