"""Result reuse at the front: each line's request key, and the lines the reuse index answers.

A key is a 16-byte BLAKE2b digest of, in order:

1. the model fingerprint (`fingerprint`): the engine, the weights (the model's
   `revision` when the operator set one, else the engine's pinned weights:
   config/defaults.py `ENGINE_PINNED_WEIGHTS`, else for transformers and vllm
   the digest of what its local workers load: ingest/weights_digest.py) and the
   sha256 of its tokenizer file; a model with none of these has no fingerprint
   and its lines never reuse (the front logs why at start);
2. the canonical shape (ingest/request_shape.py) less what cannot change the
   output: `priority`, and `encoding_format` (delivery renders the stored
   vector as the new line asks);
3. the prompt: its text (a chat's messages as (role, content) pairs) or its
   token ids.

`custom_id` and the line number are not part of it. Only deterministic
requests have a key: embeddings, temperature 0, or a fixed seed; a sampled
request without a seed, and a fan-out line (several prompts, or `n` > 1), always
run. The front looks the keys of a `--reuse` job's chunk up in the index
(pipeline/store/reuse_store.py) before anything of the chunk is sent on: a
found line leaves the chunk, and the chunk's commit record names it with
where its result lies (`reused`), and the keys of the rest (`rk`), so that
completion stores the first and indexes the results of the others.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from config.defaults import ENGINE_PINNED_WEIGHTS
from config.settings import FleetSettings, ModelSettings, WorkerSettings
from ingest.input_chunk import InputChunk
from ingest.request_shape import EMBEDDINGS, Shape
from ingest.weights_digest import CACHE_FILE, DigestCache, served_weights
from pipeline.store.intern_table import InternTable
from pipeline.store.reuse_store import REUSE_DIR, ReuseReader

log = logging.getLogger(__name__)

KEY_BYTES = 16


def fingerprint(model: ModelSettings, served: str | None = None) -> str | None:
    """The model's fingerprint, or None when its weights are not known (never reused).
    `served`: the weights its local workers load (ingest/weights_digest.py), if known."""
    weights = f"revision:{model.revision}" if model.revision else None
    weights = weights or ENGINE_PINNED_WEIGHTS.get(model.engine) or served
    if weights is None:
        return None
    tokenizer = ""
    if model.tokenizer:
        try:
            with open(model.tokenizer, "rb") as f:
                tokenizer = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            return None  # the front cannot read it either: its text lines are refused anyway
    return f"{model.engine}|{weights}|tokenizer:{tokenizer}"


def fingerprints(
    data_root: Path,
    models: Sequence[ModelSettings],
    workers: Sequence[WorkerSettings] = (),
    fleet: Sequence[FleetSettings] = (),
) -> tuple[dict[str, str | None], dict[str, str]]:
    """(every model's fingerprint, why each model without one has none), the weights of local
    workers digested once (at start)."""
    cache = DigestCache(Path(data_root) / REUSE_DIR / CACHE_FILE)
    first = models[0].name if models else ""
    out: dict[str, str | None] = {}
    whys: dict[str, str] = {}
    for model in models:
        served, why = served_weights(model, workers, fleet, cache, first_model=first)
        out[model.name] = fingerprint(model, served)
        if out[model.name] is not None:
            continue
        if model.revision or model.engine in ENGINE_PINNED_WEIGHTS or served:
            why = f"its tokenizer file {model.tokenizer} cannot be read"
        else:
            why += "; declare its weights with `revision` in its [[models]] table to reuse them"
        whys[model.name] = why
        log.info("model %s: no fingerprint, its lines never reuse (%s)", model.name, why)
    cache.save()
    return out, whys


def deterministic(shape: Shape) -> bool:
    """Whether the same request always gives the same output."""
    return shape.endpoint == EMBEDDINGS or shape.temperature == 0 or shape.seed is not None


def _shape_part(shape: Shape) -> bytes:
    values = shape.as_dict()
    values.pop("priority", None)
    values.pop("encoding_format", None)
    return orjson.dumps(values, option=orjson.OPT_SORT_KEYS)


def request_keys(chunk: InputChunk, fingerprints: dict[str, str | None]) -> np.ndarray:
    """Each item's key as [n, 2] u8 (row of zeros: the item has none)."""
    n = chunk.n_items
    out = np.zeros((n, 2), np.uint64)
    fanout = {f[0] for f in chunk.fanout}
    prefixes: dict[tuple[int, int], Any] = {}
    for m, model in enumerate(chunk.models):
        fp = fingerprints.get(model)
        if fp is None:
            continue
        for s, shape in enumerate(chunk.shapes):
            if deterministic(shape):
                h = hashlib.blake2b(digest_size=KEY_BYTES)
                h.update(fp.encode() + b"\0" + _shape_part(shape) + b"\0")
                prefixes[(m, s)] = h
    if not prefixes:
        return out
    texts = dict(zip(chunk.text_items.tolist(), chunk.texts, strict=True))
    digests = bytearray(n * KEY_BYTES)
    has = np.zeros(n, bool)
    lines, models, shapes = (
        chunk.line.tolist(),
        chunk.model_index.tolist(),
        chunk.shape_index.tolist(),
    )
    offsets = chunk.offsets.tolist()
    for i in range(n):
        prefix = prefixes.get((models[i], shapes[i]))
        if prefix is None or lines[i] in fanout:
            continue
        h = prefix.copy()
        text = texts.get(i)
        if text is None:
            h.update(b"i" + chunk.tokens[offsets[i] : offsets[i + 1]].tobytes())
        elif isinstance(text, str):
            h.update(b"t" + text.encode("utf-8", "surrogatepass"))
        else:
            h.update(b"c" + orjson.dumps(text))
        digests[i * KEY_BYTES : (i + 1) * KEY_BYTES] = h.digest()
        has[i] = True
    keys = np.frombuffer(bytes(digests), np.uint64).reshape(n, 2).copy()
    keys[has & (keys == 0).all(axis=1), 0] = 1  # a zero key means none
    return keys


def key_hex(keys: np.ndarray) -> list[str]:
    return [f"{int(a):016x}{int(b):016x}" for a, b in keys.tolist()]


def keys_of_hex(texts: Iterable[str]) -> np.ndarray:
    pairs = [(int(t[:16], 16), int(t[16:32], 16)) for t in texts]
    return np.array(pairs, np.uint64).reshape(-1, 2)


@dataclass
class ReuseFound:
    """What the lookup found of one chunk: for its commit record (pipeline/store/job_files.py)."""

    reused: list[list[Any]] = field(
        default_factory=list
    )  # [line, key, model, shape, file, offset, length]
    lines: list[int] = field(default_factory=list)  # the other keyed lines ...
    keys: list[str] = field(default_factory=list)  # ... and their keys
    unkeyed: dict[str, str] = field(default_factory=dict)  # model without a fingerprint -> why

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.unkeyed:
            out["nofp"] = self.unkeyed
        if self.reused:
            out["reused"] = self.reused
        if self.lines:
            out["rk"] = {"lines": self.lines, "keys": "".join(self.keys)}
        return out


class ReuseFinder:
    """The front's side of the index: keys a reusing job's chunk and takes out what it finds."""

    def __init__(
        self,
        data_root: Path,
        models: tuple[ModelSettings, ...],
        workers: Sequence[WorkerSettings] = (),
        fleet: Sequence[FleetSettings] = (),
    ) -> None:
        self.data_root = Path(data_root)
        self.fingerprints, self.why = fingerprints(self.data_root, models, workers, fleet)
        self.reader = ReuseReader(data_root)
        self.shapes: InternTable | None = None
        self.found = 0  # lines taken from the index (metrics)

    def take(self, chunk: InputChunk) -> tuple[InputChunk, ReuseFound]:
        """The chunk without the lines the index holds a result for, and what was found."""
        keys = request_keys(chunk, self.fingerprints)
        keyed = np.flatnonzero(keys.any(axis=1))
        found = ReuseFound()
        for m in np.unique(chunk.model_index).tolist():  # for `status` (its `reuse_off`)
            if chunk.models[m] in self.why:
                found.unkeyed[chunk.models[m]] = self.why[chunk.models[m]]
        if not len(keyed):
            return chunk, found
        where = self.reader.lookup(keys[keyed])
        hit = where[:, 0] > 0
        texts = key_hex(keys[keyed])
        lines = chunk.line.tolist()
        if hit.any():
            if self.shapes is None:
                self.shapes = InternTable(self.data_root)
            shape_ids = [self.shapes.id_for(shape.as_dict()) for shape in chunk.shapes]
            models, shapes = chunk.model_index.tolist(), chunk.shape_index.tolist()
            places = where.tolist()
            for j in np.flatnonzero(hit).tolist():
                i = int(keyed[j])
                found.reused.append(
                    [lines[i], texts[j], chunk.models[models[i]], shape_ids[shapes[i]], *places[j]]
                )
        for j in np.flatnonzero(~hit).tolist():
            found.lines.append(lines[int(keyed[j])])
            found.keys.append(texts[j])
        self.found += len(found.reused)
        drop = np.zeros(chunk.n_items, bool)
        drop[keyed[hit]] = True
        return chunk.without(drop, ()), found
