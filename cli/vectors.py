"""`python run.py vectors stats|search|export`: the vector store from the command line
(docs/vectors.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import orjson

from cli.common import address, client_options, curve
from collector.vectors.client import VectorsClient, embed_texts
from collector.vectors.search import METRICS
from collector.vectors.texts import input_texts
from collector.vectors.vector_errors import VectorInputError
from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.item_seq import index_of


def add_parser(commands) -> None:
    vectors = commands.add_parser("vectors", help="the vector store: stats, search, export")
    actions = vectors.add_subparsers(dest="action", required=True)
    stats = actions.add_parser("stats", help="stores, rows, shards, jobs being delivered")
    stats.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    client_options(stats, "vectors")
    search = actions.add_parser("search", help="exact top-k neighbours of a text or a vector")
    search.add_argument(
        "--store",
        help="store name (default: the store of the first configured model that has one)",
    )
    what = search.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", action="append", help="query text (repeat for several)")
    what.add_argument("--vector-file", help=".npy file of one vector [dim] or queries [q, dim]")
    search.add_argument("-k", type=int, default=10, help="neighbours per query (default 10)")
    search.add_argument("--metric", choices=METRICS, default="cosine", help="default cosine")
    search.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    client_options(search, "vectors")
    export = actions.add_parser("export", help="every durable vector to .npy or .parquet")
    export.add_argument("--store", required=True, help="store name")
    export.add_argument("-o", "--output", required=True, help="out.npy or out.parquet")
    client_options(export, "vectors")
    vectors.set_defaults(handler=vectors_command)


def vectors_command(args: argparse.Namespace) -> int:
    """One `vectors` action against the vector stage (--broker, else the config's)."""

    def settings_of():
        return load_settings(args.config)

    with VectorsClient(
        address(args, "vectors"), timeout_s=args.timeout, curve=curve(args)
    ) as client:
        if args.action == "stats":
            return _stats(client, args)
        if args.action == "search":
            return _search(client, args, settings_of)
        return _export(client, args)


def _stats(client: VectorsClient, args) -> int:
    info = client.stats()
    if args.json:
        print(orjson.dumps(info).decode())
        return exitcodes.OK
    if not info["stores"]:
        print("no vector stores yet (submit a job with --deliver vectors)")
    for store in info["stores"]:
        if not store.get("served", True):
            print(f"store {store['name']}: NOT SERVED: {store['reason']}")
            continue
        print(
            f"store {store['name']}: model {store['model']}, dim {store['dim']} {store['dtype']}, "
            f"{store['rows']:,} rows durable ({store['pending']:,} pending), "
            f"{store['shards']} shard(s) ({store['sealed']} sealed), "
            f"{store['bytes'] / 1e6:,.1f} MB"
        )
    for job in info["jobs"]:
        print(
            f"  delivering job {job['job']}: {job['stored']:,} stored, {job['errors']:,} error "
            f"line(s), {job['skipped']:,} skipped as already stored"
        )
    print(f"jobs delivered: {info['delivered_jobs']}; searches served: {info['searches']}")
    if info["flush_failing"]:
        print("WARNING: flushes are failing (disk full?); see the vectors stage log")
    return exitcodes.OK


def _settings(args, settings_of):
    """The config's settings, or None for a broker named by --broker alone."""
    if getattr(args, "broker", None) and not Path(args.config).exists():
        return None
    return settings_of()


def _default_store(client: VectorsClient, settings) -> str:
    """The store named after a model: the first configured model with a store, or the only
    store; else a VectorInputError listing the stores."""
    names = [store["name"] for store in client.stats()["stores"]]
    models = [m.name for m in settings.models] if settings is not None else []
    for name in models:
        if name in names:
            return name
    if len(names) == 1:
        return names[0]
    raise VectorInputError(
        f"no store is named after a configured model ({', '.join(models) or 'none'}); "
        f"name one with --store: {', '.join(names) or 'there are none yet'}"
    )


def _search(client: VectorsClient, args, settings_of) -> int:
    settings = _settings(args, settings_of)
    args.store = args.store or _default_store(client, settings)
    if args.text:
        store = client.store(args.store)
        query = embed_texts(settings_of(), store["model"], args.text)
        labels = args.text
    else:
        try:
            query = np.load(args.vector_file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise VectorInputError(f"{args.vector_file}: not a readable .npy file ({exc})") from exc
        if query.dtype.kind not in "fiu" or query.ndim not in (1, 2):
            raise VectorInputError(
                f"{args.vector_file}: holds {query.dtype} {query.shape}; need [dim] or [q, dim] numbers"
            )
        query = np.atleast_2d(query).astype(np.float32)
        labels = [f"vector {i}" for i in range(len(query))]
    hits = client.search(args.store, query, args.k, args.metric)
    meta, a = hits.meta, hits.arrays
    q, k = meta["shape"]
    index = meta.get("lines") or index_of(a["id"].reshape(-1)).tolist()  # line - 1 of each
    parts = meta.get("parts", [0] * len(index))
    texts = (
        input_texts(
            settings.data_path,
            list(zip(meta["jobs"], index, meta["custom_ids"], parts, strict=True)),
        )
        if settings is not None and not getattr(args, "broker", None)
        else [None] * len(index)
    )
    for i in range(q):
        if not args.json:
            print(f"{labels[i]!r}: top {k} of {meta['rows']:,} in {meta['seconds'] * 1000:.1f} ms")
        for j in range(k):
            at = i * k + j
            hit = {
                "query": i,
                "rank": j + 1,
                "score": round(float(a["scores"][i, j]), 6),
                "custom_id": meta["custom_ids"][at],
                "part": parts[at],
                "job": meta["jobs"][at],
                "shard": int(a["shard"][i, j]),
                "row": int(a["row"][i, j]),
                "text": texts[at],
            }
            if args.json:
                print(orjson.dumps(hit).decode())
            else:
                print(
                    f"  {j + 1:>3}. {hit['score']:.4f}  {hit['custom_id']}  "
                    f"(job {hit['job']}, shard {hit['shard']} row {hit['row']})"
                )
                if texts[at] is not None:
                    shown = " ".join(texts[at].split())
                    print(f"       {shown[:150]}{'...' if len(shown) > 150 else ''}")
    return exitcodes.OK


def _export(client: VectorsClient, args) -> int:
    from cli.progress_line import ProgressLine

    out = Path(args.output)
    with ProgressLine(every_s=5.0) as line:  # ended, whatever happens
        rows = client.export(
            args.store, out, lambda done, total: line.show(f"export: {done:,}/{total:,} rows")
        )
    extra = f" (ids and custom_ids: {out}.ids.jsonl)" if out.suffix.lower() == ".npy" else ""
    print(f"export: {rows:,} rows of store {args.store} to {out}{extra}", file=sys.stderr)
    return exitcodes.OK
