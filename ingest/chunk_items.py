"""A chunk's way to the routers: its ITEMS ring record, and which router takes it.

The front (a chunk of token ids) and the tokenizers (a chunk they tokenised)
both send a chunk on this way, so it is written once here.
"""

from __future__ import annotations

from ingest.input_chunk import InputChunk
from pipeline.transport.ring_records import Items


def items_of(chunk: InputChunk, job_no: int, deadline_ns: int) -> Items:
    """The ITEMS record of a fully tokenised chunk."""
    return Items(
        job_no=job_no,
        chunk=chunk.index,
        deadline_ns=deadline_ns,
        models=list(chunk.models),
        shapes=[s.as_dict() for s in chunk.shapes],
        index=chunk.indexes.astype("<u4"),
        model_index=chunk.model_index,
        shape_index=chunk.shape_index,
        lengths=chunk.lengths,
        tokens=chunk.tokens,
    )


def router_for(chunk_index: int, routers: int) -> int:
    """The router instance that takes a chunk: every piece of one chunk goes to one router."""
    return chunk_index % routers
