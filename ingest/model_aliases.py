"""Aliases at ingest: a chunk's models named by their own names, and the names its lines used.

A line may name its model by an alias (`[[models]] aliases`, ingest/catalog.py).
The producer and the front check each line under the name it gave; then the
front names every model of the chunk by its own name (`own_names`) before
the chunk goes on, so the tokenizers, the router, the writers, segments,
dispatch and workers know each model by one name, and lines under two names
of one model share its segments and batches.

The output repeats the name each line gave (`response.body.model`), so the
front keeps that (`WrittenNames`) until it writes the chunk's commit record,
which lists it for the stored lines that gave another name than their
model's own: `names`, the aliases they gave, and `name_ix`, one entry per
stored line (0 = its model's own name, k = `names[k - 1]`), left out when
every stored line gave `names[0]` (pipeline/store/job_files.py). A chunk whose
lines give their models' own names records neither: nothing per line, and
nothing at all for a job without aliases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ingest.catalog import ModelCatalog
from ingest.input_chunk import InputChunk


@dataclass(frozen=True, eq=False)
class WrittenNames:
    """The aliases a chunk's lines gave, and which one each item gave."""

    names: tuple[str, ...]
    line: np.ndarray  # int64: each item's line, ascending (the chunk's `line`)
    number: np.ndarray  # int64: each item's name, 0 = its model's own, k = names[k - 1]

    def record(self, lines: list[int]) -> dict[str, Any]:
        """The commit record's `names` and `name_ix` for the stored `lines` (ascending; all of
        them lines of the chunk); {} when each gave its model's own name."""
        if not lines:
            return {}
        at = np.searchsorted(self.line, np.asarray(lines, np.int64))
        number = self.number[np.minimum(at, len(self.line) - 1)]
        used = np.unique(number[number > 0])
        if not len(used):
            return {}
        renumber = np.zeros(len(self.names) + 1, np.int64)
        renumber[used] = np.arange(1, len(used) + 1)
        ix = renumber[number]
        fields: dict[str, Any] = {"names": [self.names[k - 1] for k in used.tolist()]}
        if not (ix == 1).all():
            fields["name_ix"] = ix.tolist()
        return fields


def written_names(chunk: InputChunk, catalog: ModelCatalog) -> WrittenNames | None:
    """Which alias each item of `chunk` gave; None when every item gave its model's own name."""
    own = _own(chunk, catalog)
    given = [name for name, mine in zip(chunk.models, own, strict=True) if name != mine]
    if not given:
        return None
    names = tuple(dict.fromkeys(given))
    of_model = [names.index(n) + 1 if n != m else 0 for n, m in zip(chunk.models, own, strict=True)]
    number = np.asarray(of_model, np.int64)[chunk.model_index]
    return WrittenNames(names, chunk.line.astype(np.int64), number)


def own_names(chunk: InputChunk, catalog: ModelCatalog) -> InputChunk:
    """`chunk` with each model named by its own name (one entry per model); the same chunk
    when no item gave an alias."""
    own = _own(chunk, catalog)
    if own == list(chunk.models):
        return chunk
    models = tuple(dict.fromkeys(own))
    position = np.array([models.index(m) for m in own], chunk.model_index.dtype)
    return replace(chunk, models=models, model_index=position[chunk.model_index])


def _own(chunk: InputChunk, catalog: ModelCatalog) -> list[str]:
    """Each of the chunk's model names as its model's own name (an unknown one as it is: the
    front's check rejects its items)."""
    entries = catalog.models
    return [entries[n].name if n in entries else n for n in chunk.models]
