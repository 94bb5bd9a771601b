"""The front's second look at a chunk: what the producer's SDK checked, checked here again.

Nothing from the network is trusted. For each item: its model is served,
its endpoint is one the model serves, text goes only to a model with a
tokenizer, a pre-tokenised prompt is not empty, fits the model's limit
(and the largest lane) and holds no id beyond the model's vocabulary
(`token_out_of_range`, ingest/catalog.py), and its custom_id is not used elsewhere in the job:
by a committed chunk, by another chunk in flight, or earlier in this one.
Bad items become error records (`LineError`, naming line, custom_id and
reason); a line of several parts (fan-out) is checked whole: at most
`ingest.max_inputs_per_line` parts, its token-id prompts within
`ingest.max_line_tokens` together, and one bad part rejects the line.
Items an earlier attempt already stored are set aside. Vectorised
over the chunk: one pass per model and shape, not per item. The items sent
on name each model by its own name, the aliases their lines gave kept aside
for the commit record (ingest/model_aliases.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingest.catalog import ModelCatalog
from ingest.custom_ids import CustomIdSet, Digests, digests
from ingest.id_digest import blob_digests
from ingest.input_chunk import InputChunk
from ingest.line_errors import (
    DUPLICATE_CUSTOM_ID,
    EMPTY_PROMPT,
    ENDPOINT_NOT_SERVED,
    LINE_TOO_MANY_TOKENS,
    PROMPT_TOO_LONG,
    TEXT_NOT_ACCEPTED,
    TOKEN_OUT_OF_RANGE,
    TOO_MANY_INPUTS,
    UNKNOWN_MODEL,
    LineError,
)
from ingest.line_parser import too_many_tokens
from ingest.line_prompts import beyond_vocabulary
from ingest.model_aliases import WrittenNames, own_names, written_names


@dataclass(frozen=True, eq=False)
class Checked:
    chunk: InputChunk  # the items to send on, with the new error records added
    already: list[tuple[int, str]]  # (line, custom_id) of items already in the log
    digests: Digests  # custom_id digests of `chunk`'s items
    written: WrittenNames | None = None  # the aliases its lines gave (None: their models' names)


def recheck(
    chunk: InputChunk,
    catalog: ModelCatalog,
    committed: CustomIdSet,
    in_flight: list[np.ndarray],
    stored: np.ndarray | None,
    hashed: Digests | None = None,
) -> Checked:
    """Check `chunk`; `in_flight` holds the digest highs of the job's other chunks in flight,
    `stored` the item indexes of this chunk already in the log (None on a first attempt),
    `hashed` the digests of its custom_ids when known (from the wire: `chunk_digests`, one per
    item)."""
    n = chunk.n_items
    drop = np.zeros(n, dtype=bool)
    errors: list[LineError] = []

    # a fan-out line is several items (its parts): one error per line, and all of it dropped
    first_of_line = np.ones(n, dtype=bool)
    first_of_line[1:] = np.diff(chunk.line.astype(np.int64)) != 0

    def reject(mask: np.ndarray, code: str, reason) -> None:
        mask = mask & ~drop
        if chunk.fanout and mask.any():
            reported = set()
            for i in np.flatnonzero(mask).tolist():
                line = int(chunk.line[i])
                if line not in reported:
                    reported.add(line)
                    errors.append(LineError.at(line, chunk.custom_ids[i], code, reason(i)))
            mask = np.isin(chunk.line, chunk.line[mask])
        else:
            for i in np.flatnonzero(mask).tolist():
                line = int(chunk.line[i])
                errors.append(LineError.at(line, chunk.custom_ids[i], code, reason(i)))
        drop[mask] = True

    lengths = chunk.lengths.astype(np.int64)
    is_text = np.zeros(n, dtype=bool)
    is_text[chunk.text_items] = True
    token_ids = chunk.tokens[: int(chunk.offsets[-1])] if n else chunk.tokens[:0]
    top = int(token_ids.max()) if len(token_ids) else -1  # one pass, no per-item max
    largest = None  # each item's largest id: only when some id is beyond some vocabulary
    for m, name in enumerate(chunk.models):
        of_model = chunk.model_index == m
        entry = catalog.models.get(name)
        if entry is None:
            reject(
                of_model, UNKNOWN_MODEL, lambda i, name=name: f"model {name!r} is not served here"
            )
            continue
        for s, shape in enumerate(chunk.shapes):
            if shape.endpoint not in entry.endpoints:
                reject(
                    of_model & (chunk.shape_index == s),
                    ENDPOINT_NOT_SERVED,
                    lambda i, name=name, url=shape.endpoint: f"model {name!r} does not serve {url}",
                )
        if not entry.takes_text:
            reject(
                of_model & is_text,
                TEXT_NOT_ACCEPTED,
                lambda i, name=name: f"model {name!r} takes only prompt_token_ids",
            )
        limit = entry.prompt_limit_tokens
        reject(
            of_model & ~is_text & (lengths > limit),
            PROMPT_TOO_LONG,
            lambda i, limit=limit: (
                f"prompt of {lengths[i]} tokens is longer than the limit of {limit}"
            ),
        )
        vocab = entry.vocab_size
        if vocab is not None and top >= vocab:
            if largest is None:
                largest = item_max(chunk.tokens, chunk.offsets)
            reject(
                of_model & ~is_text & (largest >= vocab),
                TOKEN_OUT_OF_RANGE,
                lambda i, name=name, vocab=vocab: _beyond(chunk, i, name, vocab),
            )
    reject(~is_text & (lengths == 0), EMPTY_PROMPT, lambda i: "prompt has no tokens")
    if chunk.fanout:  # the per-line limits (text lines' budget is checked after tokenising)
        too_many = [f[0] for f in chunk.fanout if f[1] > catalog.max_parts]
        reject(
            np.isin(chunk.line, too_many),
            TOO_MANY_INPUTS,
            lambda i: f"the line has more than {catalog.max_parts} parts",
        )
        starts = np.flatnonzero(first_of_line)
        totals = np.add.reduceat(np.where(is_text, 0, lengths), starts) if n else starts
        over = chunk.line[starts[totals > catalog.max_line_tokens]]
        reject(
            np.isin(chunk.line, over),
            LINE_TOO_MANY_TOKENS,
            lambda i: too_many_tokens(
                int(lengths[chunk.line == chunk.line[i]].sum()), catalog.max_line_tokens
            ),
        )
    if hashed is None:
        hashed = digests(chunk.custom_ids)
    repeated = committed.contains((), digests=hashed)
    if chunk.fanout:  # the parts of one line share its custom_id: compare lines, not items
        line_of = np.cumsum(first_of_line) - 1
        repeated |= repeats_within(hashed[0][first_of_line])[line_of]
    else:
        repeated |= repeats_within(hashed[0])
    if in_flight:  # high 64 bits only: a false match is about n**2 / 2**64
        repeated |= members_of(hashed[0], np.sort(np.concatenate(in_flight)))
    reject(
        repeated, DUPLICATE_CUSTOM_ID, lambda i: "custom_id is used by an earlier line of this job"
    )
    already: list[tuple[int, str]] = []
    if stored is not None:  # per item: a fan-out line may be stored in part
        in_log = np.isin(chunk.indexes, stored) & ~drop
        already = sorted(
            {(int(chunk.line[i]), chunk.custom_ids[i]) for i in np.flatnonzero(in_log).tolist()}
        )
        drop |= in_log
    # rejected lines are dropped whole above; a part already stored leaves the rest of its line
    sent = own_names(chunk.without(drop, errors, whole_lines=False), catalog)
    keep = ~drop & first_of_line if chunk.fanout else ~drop
    return Checked(sent, already, (hashed[0][keep], hashed[1][keep]), written_names(chunk, catalog))


def chunk_digests(arrays: dict[str, np.ndarray]) -> Digests:
    """The custom_id digests of a chunk straight from its wire arrays (`ids`, `ids_offsets`,
    checked by `chunk_from_wire`): the same as `digests(chunk.custom_ids)`, without the strs."""
    return blob_digests(arrays["ids"].view(np.uint8), arrays["ids_offsets"])


def item_max(tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The largest token id of each item (int64), -1 for an item with none."""
    starts, ends = offsets[:-1], offsets[1:]
    out = np.full(len(starts), -1, dtype=np.int64)
    filled = ends > starts
    if filled.any():
        # reduceat runs from each start given to the next: with the empty items left out,
        # that is where each filled item ends (the last runs to the end of `tokens`)
        out[filled] = np.maximum.reduceat(tokens[: int(offsets[-1])], starts[filled])
    return out


def _beyond(chunk: InputChunk, i: int, model: str, vocab: int) -> str:
    ids = chunk.tokens[chunk.offsets[i] : chunk.offsets[i + 1]]
    at = int(np.argmax(ids >= vocab))
    return beyond_vocabulary(model, at, int(ids[at]), vocab)


def repeats_within(keys: np.ndarray) -> np.ndarray:
    """True for every key equal to an earlier one (np.unique is far slower for this)."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    repeated = np.zeros(len(keys), dtype=bool)
    repeated[order[1:][ranked[1:] == ranked[:-1]]] = True
    return repeated


def members_of(keys: np.ndarray, sorted_pool: np.ndarray) -> np.ndarray:
    """True where a key is in `sorted_pool`."""
    if len(sorted_pool) == 0:
        return np.zeros(len(keys), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_pool, keys), len(sorted_pool) - 1)
    return sorted_pool[at] == keys
