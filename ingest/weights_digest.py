"""The weights a model's local workers load, as a digest: result reuse's model fingerprint.

A model on the `transformers` or `vllm` engine without a declared `revision`
gets its weights from the `model` option of its `[[workers]]` tables, which
the front digests at start (`served_weights`):

| `model` option                          | weights in the fingerprint                  |
|-----------------------------------------|---------------------------------------------|
| none (transformers), `smollm2` (vllm)   | `sha256:` the pinned SmolLM2 GGUF's (`SMOLLM2_SHA256`, which the engine checks at load; vllm writes its directory from that file) |
| a file (a `.gguf`)                      | `sha256:` of the file                       |
| a local directory                       | `dir-sha256:` over its weight, config and tokenizer files (`directory_sha256`) |
| a Hugging Face id, a path not here, none (vllm) | none: the model never reuses until it declares a `revision` |

A model with no local worker (only remote ones, or a `[[fleet]]` table: Ray
actors on other hosts) or whose local groups load different weights has none
either: the front cannot see what those load. The other worker options
(`dtype`, `device`, ...) join the digest, since they may change the numbers.

A directory's digest is a sha256 over its files' relative names, sizes and
sha256s, for the files whose suffix is in `WEIGHT_SUFFIXES` (not README.md,
LICENSE, images, hidden directories). Each file's sha256 is kept in
`<data_dir>/reuse/weights-digests.json`, keyed by (path, size, mtime_ns), so
a restart reads no weights that did not change. A file modified less than
`RACY_NS` before it was hashed is not kept (its mtime might not move on a
second write in the same clock tick, as git's "racily clean" entries), and the
file keeps only the entries of the last start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from config.defaults import SMOLLM2_SHA256
from config.settings import FleetSettings, ModelSettings, WorkerSettings
from pipeline.store.durable import write_whole

log = logging.getLogger(__name__)

DIGESTED_ENGINES = ("transformers", "vllm")  # engines whose weights the front digests
CACHE_FILE = "weights-digests.json"  # under <data_dir>/reuse/
# weights, configs, tokenizers (vocab.txt, merges.txt, spiece.model), remote modelling code
WEIGHT_SUFFIXES = frozenset(
    {
        *(".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx", ".npz"),
        *(".json", ".model", ".tiktoken", ".txt", ".py"),
    }
)
RACY_NS = 2_000_000_000  # a file younger than this at hashing is hashed again next start
SMOLLM2_OPTION = "smollm2"  # the vllm engine's option for the directory made from the GGUF


class DigestCache:
    """Files' sha256, kept across starts keyed by (path, size, mtime_ns)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, list[Any]] = {}
        try:
            loaded = json.loads(self.path.read_bytes())
            if isinstance(loaded, dict):
                self.entries = loaded
        except (OSError, ValueError):
            pass  # none yet, or damaged: every file is hashed again
        self.kept: dict[str, list[Any]] = {}
        self.hashed = 0  # files read this start (tests, logs)

    def file_sha256(self, path: Path) -> tuple[int, str]:
        """(size, sha256 hex) of the file at `path`: from the cache when unchanged."""
        st = path.stat()
        name = str(path)
        entry = self.entries.get(name)
        if isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns]:
            self.kept[name] = entry
            return st.st_size, str(entry[2])
        started_ns = time.time_ns()
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self.hashed += 1
        after = path.stat()
        if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and (
            st.st_mtime_ns < started_ns - RACY_NS
        ):
            self.kept[name] = [st.st_size, st.st_mtime_ns, digest]
        return st.st_size, digest

    def save(self) -> None:
        """Keep this start's entries (and only those) for the next one."""
        if self.kept == self.entries:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(self.path, json.dumps(self.kept, sort_keys=True).encode())
        except OSError as exc:  # the digests stand; the next start hashes again
            log.warning("cannot keep the weights' digests in %s (%s)", self.path, exc)
        self.entries = dict(self.kept)


def weight_files(directory: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of the directory's weight, config and tokenizer files, sorted."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = Path(root) / name
            if not name.startswith(".") and path.suffix.lower() in WEIGHT_SUFFIXES:
                found.append((path.relative_to(directory).as_posix(), path))
    return sorted(found)


def directory_sha256(directory: Path, cache: DigestCache) -> str | None:
    """The directory's digest (the module docstring), or None when it has no weight files."""
    files = weight_files(directory)
    if not files:
        return None
    h = hashlib.sha256()
    for name, path in files:
        size, digest = cache.file_sha256(path)
        h.update(f"{name}\0{size}\0{digest}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def source_weights(engine: str, source: Any, cwd: Path, cache: DigestCache) -> str | None:
    """The weights of one worker group's `model` option (the module docstring's table)."""
    if source is None or source == "":
        return f"sha256:{SMOLLM2_SHA256}" if engine == "transformers" else None
    if engine == "vllm" and source == SMOLLM2_OPTION:
        return f"sha256:{SMOLLM2_SHA256}"
    path = cwd / Path(str(source)).expanduser()  # the workers share the front's directory
    try:
        if path.is_file():
            return f"sha256:{cache.file_sha256(path)[1]}"
        if path.is_dir():
            digest = directory_sha256(path, cache)
            return f"dir-sha256:{digest}" if digest else None
    except OSError as exc:
        log.warning("cannot digest the weights at %s (%s): its model never reuses", path, exc)
    return None  # a Hugging Face id, or a path not on this host


def served_weights(
    model: ModelSettings,
    workers: Sequence[WorkerSettings],
    fleet: Sequence[FleetSettings],
    cache: DigestCache,
    cwd: Path | None = None,
    first_model: str = "",
) -> tuple[str | None, str]:
    """(the weights the model's local workers load, or None; why none). Only for a model on a
    digested engine without a `revision`: the others say theirs (ingest/reuse_keys.py).
    `first_model`: the model a [[workers]] table without `model` serves (the first one)."""
    if model.engine not in DIGESTED_ENGINES or model.revision:
        return None, f"engine {model.engine}: the front cannot see the weights it serves"
    if any(f.model == model.name for f in fleet):
        return None, "its [[fleet]] actors load weights on other hosts"
    groups = [g for g in workers if g.local and (g.model or first_model) == model.name]
    if not groups:
        return None, "no local [[workers]] table serves it (remote workers cannot be seen)"
    cwd = cwd or Path.cwd()
    found = set()
    for group in groups:
        if group.engine not in DIGESTED_ENGINES:
            return (
                None,
                f"its workers run the {group.engine} engine, whose weights are not digested",
            )
        options = dict(group.options)
        weights = source_weights(group.engine, options.pop("model", None), cwd, cache)
        if weights is None:
            return None, (
                f"its workers' model option {dict(group.options).get('model')!r} is not a "
                "local file or directory, nor the pinned SmolLM2"
            )
        rest = json.dumps(options, sort_keys=True, default=str) if options else ""
        found.add(f"{weights}|options:{rest}" if rest else weights)
    if len(found) > 1:
        return None, "its [[workers]] tables load different weights or options"
    return found.pop(), ""
