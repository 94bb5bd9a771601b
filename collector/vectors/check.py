"""The vector stores' part of `python run.py check`: every shard opened read-only, every batch
re-checksummed.

| code                         | meaning                                                   | fixable |
|------------------------------|-----------------------------------------------------------|---------|
| `vector-store-unreadable`    | store.json missing or unreadable, a shard missing, dims disagree, a shard not sealed before the next | no |
| `vector-shard-damaged`       | a shard fails recovery (acknowledged rows lost, damage mid-journal, bad header): never served | no |
| `vector-checksum`            | a journalled batch's bytes fail its checksum              | no |
| `vector-torn-journal`        | a torn last journal record (a crash mid-flush): recovery cuts it | yes |
| `vector-unacknowledged-rows` | payload or ids bytes past the journal (a crash mid-flush): recovery cuts them | yes |
| `vector-stray-file`          | a file in a store that is not a shard file                | no |
| `vector-store-in-use`        | a running broker has the store open: stop it to check the store | no |

`fix` opens the store for writing, which runs recovery (cutting only bytes
that were never acknowledged), then checks again.
"""

from __future__ import annotations

from pathlib import Path

from collector.vectors.store_catalog import (
    META_FILE,
    SINK_DIRS,
    open_store,
    read_meta,
    store_dirs,
    store_name_of,
    stores_root,
)
from collector.vectors.vector_errors import VectorError, VectorShardBusy
from pipeline.store.check import Finding

SHARD_SUFFIXES = (".payload", ".ids", ".journal")


def check_vectors(data_path: Path, fix: bool = False) -> tuple[list[Finding], list[str]]:
    """(findings as found, what fix did) for every store under `<data_path>/vectors`."""
    root = stores_root(data_path)
    findings: list[Finding] = []
    fixed: list[str] = []
    for directory in store_dirs(root):
        found = _check_store(directory)
        findings += found
        if fix and any(f.fixable for f in found):
            try:
                _, store = open_store(root, store_name_of(directory))
                store.close()
                fixed.append(f"{directory}: recovered (cut bytes past the journal)")
            except (VectorError, OSError) as exc:
                fixed.append(f"{directory}: recovery failed: {exc}")
    return findings, fixed


def _check_store(directory: Path) -> list[Finding]:
    if not (directory / META_FILE).exists():
        return [Finding(directory, "vector-store-unreadable", f"no {META_FILE}: not a store")]
    try:
        read_meta(directory)
    except VectorError as exc:
        return [Finding(directory, "vector-store-unreadable", str(exc))]
    findings = [
        Finding(path, "vector-stray-file", "not a shard file; left alone")
        for path in sorted(directory.iterdir())
        if path.name != META_FILE
        and path.suffix not in SHARD_SUFFIXES
        and path.name not in SINK_DIRS
    ]
    try:
        _, store = open_store(directory.parent, store_name_of(directory), readonly=True)
    except VectorShardBusy as exc:
        return [*findings, Finding(directory, "vector-store-in-use", str(exc))]
    except (VectorError, OSError) as exc:
        reason = str(exc)
        shard_file = any(suffix in reason for suffix in SHARD_SUFFIXES)
        code = "vector-shard-damaged" if shard_file else "vector-store-unreadable"
        return [*findings, Finding(directory, code, reason)]
    try:
        for shard in store.shards:
            for code, what in shard.findings:
                findings.append(Finding(shard.journal_path, code, what, True))
            for problem in shard.verify():
                findings.append(Finding(shard.journal_path, "vector-checksum", problem))
    finally:
        store.close()
    return findings
