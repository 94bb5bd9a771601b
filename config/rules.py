"""What each configuration key allows: its type, its range, and how to say so.

`RULES` holds one `Rule` per dotted key of the plain sections and
`MODEL_RULES` one per key of a `[[models]]` table; a test keeps both in step
with `config/defaults.py`. `config/validate.py` walks the data and applies
them. Limits that are part of the contract live here as named constants.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from config.defaults import ENDPOINTS, ENGINE_ENDPOINTS
from pipeline.store.model_names import NAME_RULE, name_problem
from pipeline.transport.binds import host_port, is_wildcard

MIN_SEGMENT_BYTES: Final = 1024 * 1024
MIN_FIRST_SEGMENT_BYTES: Final = 64 * 1024
MAX_LANE_TOKENS: Final = 1 << 20
# Longest ipc:// path the OS accepts (sizeof(sockaddr_un.sun_path) - 1 on Linux).
MAX_IPC_PATH_BYTES: Final = 107
MIN_HEADER_BYTES: Final = 4096  # api.max_header_bytes: below it, ordinary clients are refused


@dataclass(frozen=True, slots=True)
class Rule:
    """How one key is checked: its type, what is allowed, and the value check.

    `problem(value)` is called only on a value of the right type and returns
    what is wrong with it ("is below 1") or None when it is fine.
    """

    kind: str
    allowed: str
    problem: Callable[[Any], str | None]

    def accepts(self, value: Any) -> bool:
        """True if `value` has this rule's type (an int counts as a number, a bool never)."""
        return _has_kind(value, self.kind)


def count(low: int, note: str = "") -> Rule:
    """An integer >= `low`."""
    return Rule(
        "integer", f"an integer >= {low}{note}", lambda v: f"is below {low}" if v < low else None
    )


def interval(unit: str, *, zero_ok: bool) -> Rule:
    """A finite number of `unit`s, > 0 (or >= 0 when `zero_ok`)."""

    def problem(value: float) -> str | None:
        if not math.isfinite(value):
            return "is not a finite number"
        if value < 0 or (value == 0 and not zero_ok):
            return "is negative" if value < 0 else "is zero"
        return None

    return Rule("number", f"a number {'>=' if zero_ok else '>'} 0 ({unit})", problem)


WEBHOOK_KEYS: Final = ("owner", "url", "secret_file", "allow_batch_url")


def webhooks_problem(tables: list[dict[str, Any]]) -> str | None:
    """What is wrong with the [[api.webhooks]] tables (a URL's host is judged at start)."""
    owners: dict[str, int] = {}
    for i, table in enumerate(tables):
        for key in table:
            if key not in WEBHOOK_KEYS:
                return f"has webhooks[{i}].{key}, not a key of [[api.webhooks]] ({', '.join(WEBHOOK_KEYS)})"
        for key in WEBHOOK_KEYS[:3]:
            if not isinstance(table.get(key), str) or not table[key]:
                return f"has webhooks[{i}] without a {key} string"
        if not isinstance(table.get("allow_batch_url", False), bool):
            return f"has webhooks[{i}].allow_batch_url that is not true or false"
        if not table["url"].startswith(("http://", "https://")):
            return f"has webhooks[{i}].url = {json.dumps(table['url'])}, not an http(s):// URL"
        if table["owner"] in owners:
            return f"has webhooks[{i}].owner = {json.dumps(table['owner'])} again (webhooks[{owners[table['owner']]}])"
        owners[table["owner"]] = i
    return None


def _lanes_problem(lanes: list[int]) -> str | None:
    if not lanes:
        return "is empty"
    if lanes[0] <= 0:
        return f"starts at {lanes[0]}, not above 0"
    for low, high in itertools.pairwise(lanes):
        if high <= low:
            return f"is not strictly increasing ({low} is followed by {high})"
    if lanes[-1] > MAX_LANE_TOKENS:
        return f"ends above {MAX_LANE_TOKENS} tokens ({lanes[-1]})"
    return None


def _options_problem(options: dict[str, Any]) -> str | None:
    for key, value in options.items():
        if not isinstance(value, bool | int | float | str):
            return f"has {key} = {json.dumps(value, default=str)}, not a number, string or boolean"
    return None


# a tcp:// address's host, as pipeline/transport/binds.py `host_port` gives it (an IPv6
# host's brackets taken off): a wildcard, an IPv6 address, or a name or IPv4 address
TCP_HOST = re.compile(r"\*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|[A-Za-z0-9._-]+")


def _tcp_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a well-formed tcp://HOST:PORT (an IPv6 host in brackets), else None."""
    target = host_port(address) if address.startswith("tcp://") else None
    if target is None or not TCP_HOST.fullmatch(target[0]):
        return None
    ipv6 = ":" in target[0]
    return target if ipv6 == address.startswith("tcp://[") else None


def _address_problem(address: str) -> str | None:
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        if not path:
            return "has an empty ipc path"
        if len(path.encode()) > MAX_IPC_PATH_BYTES:
            return f"has an ipc path longer than the OS limit of {MAX_IPC_PATH_BYTES} bytes"
        return None
    target = _tcp_host_port(address)
    if target is None:
        return "is not a tcp://host:port or ipc://path address"
    if not 1 <= target[1] <= 65535:
        return f"has port {target[1]}, outside 1-65535 (clients must know the port)"
    return None


def _endpoints_problem(endpoints: list[str]) -> str | None:
    if not endpoints:
        return "is empty"
    for endpoint in endpoints:
        if endpoint not in ENDPOINTS:
            return f"names {json.dumps(endpoint)}, which is not an endpoint"
    if len(set(endpoints)) < len(endpoints):
        return "names an endpoint twice"
    return None


def _aliases_problem(aliases: list[str]) -> str | None:
    for alias in aliases:
        problem = name_problem(alias)
        if problem is not None:
            return f"has {json.dumps(alias)}: it {problem}"
    for i, alias in enumerate(aliases):
        if alias in aliases[:i]:
            return f"names {json.dumps(alias)} twice"
    return None


ADDRESS = Rule("string", "tcp://HOST:PORT (PORT 1-65535) or ipc://PATH", _address_problem)


def _http_address_problem(address: str) -> str | None:
    if address == "":
        return None  # no endpoint
    problem = _address_problem("tcp://" + address)
    if problem is not None or address.startswith("*"):
        return "is not a HOST:PORT address (e.g. 127.0.0.1:7719; 0.0.0.0 for every interface)"
    return None


# An HTTP listening address: HOST:PORT, or "" for none. It takes a TCP port like ADDRESS does.
HTTP_ADDRESS = Rule(
    "string", 'HOST:PORT (PORT 1-65535), or "" for no endpoint', _http_address_problem
)

RULES: Final[dict[str, Rule]] = {
    "broker.data_dir": Rule("string", "a non-empty path", lambda v: None if v else "is empty"),
    "broker.segment_bytes": count(MIN_SEGMENT_BYTES, " (1 MiB)"),
    "broker.segment_min_bytes": count(MIN_FIRST_SEGMENT_BYTES, " (64 KiB)"),
    "broker.segment_idle_s": interval("seconds", zero_ok=False),
    "broker.lanes": Rule(
        "list of integers",
        f"a non-empty list of token counts, each > 0, strictly increasing, "
        f"at most {MAX_LANE_TOKENS}, e.g. [64, 128, 256]",
        _lanes_problem,
    ),
    "broker.recovery_processes": count(0, " (0 = one per CPU core)"),
    "ingest.bind": ADDRESS,
    "ingest.processes": count(1),
    "ingest.max_message_bytes": count(1),
    "ingest.chunk_items": count(1),
    "ingest.max_inputs_per_line": count(1),
    "ingest.max_line_tokens": count(1),
    "ingest.chunk_timeout_s": interval("seconds", zero_ok=False),
    "ingest.max_chunks_in_flight": count(1),
    "ingest.producer_chunks_in_flight": count(1),
    "ingest.max_inflight_bytes": count(1),
    "ingest.producer_inflight_bytes": count(1),
    "ingest.max_connections": count(1),
    "ingest.max_peer_connections": count(1),
    "router.processes": count(1),
    "writers.processes": count(1),
    "writers.flush_ms": interval("milliseconds", zero_ok=True),
    "writers.drop_synced_pages": Rule("boolean", "true or false", lambda v: None),
    "dispatch.bind": ADDRESS,
    "dispatch.heartbeat_bind": ADDRESS,
    "dispatch.lease_s": interval("seconds", zero_ok=False),
    "dispatch.session_timeout_s": interval("seconds", zero_ok=False),
    "dispatch.max_attempts": Rule(
        "integer",
        "an integer from 1 to 255",
        lambda v: None if 1 <= v <= 255 else "is outside 1-255",
    ),
    "dispatch.report_s": interval("seconds", zero_ok=False),
    "dispatch.reregister_grace_s": interval("seconds", zero_ok=True),
    "dispatch.session_max_batches": count(1),
    "dispatch.stall_batch_multiple": Rule(
        "number",
        "0 (off) or a number >= 2",
        lambda v: None if v == 0 or v >= 2 else "is between 0 and 2",
    ),
    "dispatch.stall_min_s": interval("seconds", zero_ok=False),
    "dispatch.demand_horizon_s": interval("seconds", zero_ok=False),
    "dispatch.compact_min_bytes": count(4096, " (4 KiB)"),
    "dispatch.max_message_bytes": count(4096, " (4 KiB)"),
    "completion.bind": ADDRESS,
    "completion.processes": Rule(
        "integer",
        "1 (one process owns every tombstone)",
        lambda v: None if v == 1 else "is not 1",
    ),
    "completion.tombstone_flush_ms": interval("milliseconds", zero_ok=False),
    "completion.results_retention_s": interval("seconds", zero_ok=True),
    "completion.page_items": count(1),
    "completion.max_message_bytes": count(4096, " (4 KiB)"),
    "completion.reuse_retention_s": interval("seconds", zero_ok=False),
    "completion.reuse_max_bytes": count(1),
    "vectors.bind": ADDRESS,
    "vectors.flush_ms": interval("milliseconds", zero_ok=False),
    "vectors.shard_bytes": count(MIN_SEGMENT_BYTES),
    "vectors.dtype": Rule(
        "string",
        '"float32" or "float16"',
        lambda v: None if v in ("float32", "float16") else "is not a supported dtype",
    ),
    "vectors.search_block_rows": count(1),
    "vectors.page_items": Rule(
        "integer",
        "an integer from 1 to 65536",
        lambda v: None if 1 <= v <= 65536 else "is outside 1-65536",
    ),
    "collector.interval_s": interval("seconds", zero_ok=False),
    "workers.local": count(0, " (0 = remote workers only)"),
    "workers.model": Rule("string", 'a model name, or "" for the first model', lambda v: None),
    "workers.engine": Rule(
        "string",
        f'"" (the model\'s engine) or one of {", ".join(sorted(ENGINE_ENDPOINTS))}',
        lambda v: None if v == "" or v in ENGINE_ENDPOINTS else "is not an engine",
    ),
    "workers.options": Rule(
        "table",
        "a table of engine options, each a number, a string or a boolean, e.g. {threads = 2}",
        _options_problem,
    ),
    "workers.simulated_tokens_per_s": interval("tokens per second", zero_ok=False),
    "workers.batch_items": count(1),
    "workers.batch_tokens": count(1),
    "workers.prefetch": count(1),
    "workers.target_batch_s": interval("seconds", zero_ok=True),
    "workers.drain_s": interval("seconds", zero_ok=True),
    "workers.batch_timeout_s": interval("seconds", zero_ok=True),
    "supervisor.restart_backoff_s": interval("seconds", zero_ok=True),
    "supervisor.max_restarts": count(0),
    "supervisor.restart_window_s": interval("seconds", zero_ok=False),
    "supervisor.stop_timeout_s": interval("seconds", zero_ok=False),
    "metrics.bind": HTTP_ADDRESS,
    "metrics.interval_s": interval("seconds", zero_ok=False),
    "api.enabled": Rule("boolean", "true or false", lambda v: None),
    "api.bind": Rule(
        "string",
        "HOST:PORT (PORT 1-65535)",
        lambda v: "is empty" if not v else _http_address_problem(v),
    ),
    "api.processes": count(1),
    "api.keys_file": Rule(
        "string", 'a path to a file of "SHA256-HEX OWNER" lines, or "" for none', lambda v: None
    ),
    "api.input_file_expiry_s": interval("seconds", zero_ok=False),
    "api.max_upload_bytes": count(1),
    "api.max_header_bytes": count(MIN_HEADER_BYTES, " (an HTTP client's headers need a few KiB)"),
    "api.max_connections": count(1),
    "api.request_head_timeout_s": interval("seconds", zero_ok=False),
    "api.keep_alive_timeout_s": interval("seconds", zero_ok=False),
    "api.webhook_give_up_s": interval("seconds", zero_ok=False),
    "api.webhook_timeout_s": interval("seconds", zero_ok=False),
    "api.webhook_hosts": Rule(
        "list of strings", "a list of host names or addresses receivers may be on", lambda v: None
    ),
    "api.webhooks": Rule(
        "list of tables",
        "[[api.webhooks]] tables, each with owner, url (http:// or https://), secret_file "
        "and optionally allow_batch_url = true, one per owner",
        lambda v: webhooks_problem(v),
    ),
    "security.server_key": Rule(
        "string", 'a path to the broker\'s NAME.key_secret, or "" for none', lambda v: None
    ),
    "security.authorized_keys": Rule(
        "string", 'a directory of allowed *.key files, or "" for none', lambda v: None
    ),
    "security.allow_insecure": Rule("boolean", "true or false", lambda v: None),
    "security.client_key": Rule(
        "string", 'a path to this client\'s NAME.key_secret, or "" for server_key', lambda v: None
    ),
    "security.server_public_key": Rule(
        "string", 'a path to the broker\'s NAME.key, or "" for that of server_key', lambda v: None
    ),
}

# One [[workers]] table: the keys of [workers], with `count` in place of `local`.
WORKER_GROUP_RULES: Final[dict[str, Rule]] = {
    "count": count(1, " (worker processes for this model)"),
    **{
        key.removeprefix("workers."): rule
        for key, rule in RULES.items()
        if key.startswith("workers.") and key != "workers.local"
    },
}

# One [[fleet]] table (config/defaults.py FLEET_DEFAULTS): its Ray keys, then those of a
# [[workers]] table but `count`.
FLEET_RULES: Final[dict[str, Rule]] = {
    "model": WORKER_GROUP_RULES["model"],
    "min": count(0, " (0: no actor while the model has no work)"),
    "max": count(1),
    "num_gpus": interval("GPUs", zero_ok=True),
    "num_cpus": interval("CPUs", zero_ok=True),
    "accelerator_type": Rule(
        "string", 'a Ray accelerator type such as "H100", or "" for any', lambda v: None
    ),
    **{key: rule for key, rule in WORKER_GROUP_RULES.items() if key not in ("count", "model")},
}

MODEL_RULES: Final[dict[str, Rule]] = {
    "name": Rule("string", f"a name of {NAME_RULE}", name_problem),
    "engine": Rule(
        "string",
        f"one of {', '.join(ENGINE_ENDPOINTS)}",
        lambda v: None if v in ENGINE_ENDPOINTS else "is not a known engine",
    ),
    "tokenizer": Rule(
        "string", 'a path to tokenizer.json, or "" for token ids only', lambda v: None
    ),
    "max_tokens": count(1, " that fits the largest lane"),
    "vocab_size": count(0, " (0 = from the tokenizer or the engine)"),
    "endpoints": Rule(
        "list of strings",
        f"a non-empty list drawn from {', '.join(ENDPOINTS)}",
        _endpoints_problem,
    ),
    "aliases": Rule(
        "list of strings",
        f"a list of other names for the model, each {NAME_RULE}",
        _aliases_problem,
    ),
    "revision": Rule(
        "string",
        'a declared revision of the weights (at most 128 characters), or ""',
        lambda v: None if len(v) <= 128 else "is longer than 128 characters",
    ),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "integer":
        return _is_int(value)
    if kind == "number":
        return _is_int(value) or isinstance(value, float)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "table":
        return isinstance(value, dict)
    if kind == "list of tables":
        return isinstance(value, list) and all(isinstance(v, dict) for v in value)
    if kind == "list of integers":
        return isinstance(value, list) and all(_is_int(v) for v in value)
    if kind == "list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise ValueError(f"rule kind {kind!r} is not one this module knows")


def clash(a: str, b: str) -> bool:
    """True if binding both addresses on one host would fail (same port, or same ipc path)."""
    ta, tb = _tcp_host_port(a), _tcp_host_port(b)
    if ta is None or tb is None:
        return a == b
    (host_a, port_a), (host_b, port_b) = ta, tb
    same_host = host_a == host_b or is_wildcard(host_a) or is_wildcard(host_b)
    return port_a == port_b and same_host
