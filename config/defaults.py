"""The one defaults table: every configuration key, its default and its meaning.

`DEFAULTS` mirrors the TOML file: one nested dict per section, plus `models`,
the list of `[[models]]` tables used when a file names none. `MODEL_DEFAULTS`
holds the keys of one `[[models]]` table; `REQUIRED` marks the keys a table
must set itself and `BY_ENGINE` a default taken from `ENGINE_ENDPOINTS`. `ENGINE_ENDPOINTS` is both the list of engines and the
endpoints each one serves when a model does not set `endpoints`: embedding
engines serve `/v1/embeddings`, every other engine serves chat and text
completions.

Units live in the key names (`_bytes`, `_s`, `_ms`, `_tokens`). Nothing else
in the code base repeats these values: the frozen settings in
`config/settings.py` are built from this table merged with the file, and
`config/validate.py` holds the rule for each key. Treat these objects as
read-only.
"""

from __future__ import annotations

from typing import Any, Final

# Marks a `[[models]]` key that has no default and must be set in each table.
REQUIRED: Final = object()
# Marks a `[[models]]` key whose default is the engine's entry in ENGINE_ENDPOINTS.
BY_ENGINE: Final = object()

DEFAULTS: Final[dict[str, Any]] = {
    "broker": {
        # Root of all durable state (segments, completion log, jobs, log/);
        # relative paths resolve against the working directory at load time.
        "data_dir": "var/fabric",
        # An input segment file rotates when it reaches this size (256 MiB).
        "segment_bytes": 256 * 1024 * 1024,
        # A lane's first segment is this size (4 MiB); each one opened because the
        # last filled up is twice the size, up to segment_bytes. Idle lanes restart small.
        "segment_min_bytes": 4 * 1024 * 1024,
        # A segment with no append for this long is sealed and rotated.
        "segment_idle_s": 30.0,
        # Lane edges in tokens: an item goes to the smallest lane >= its length.
        "lanes": [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
        # Processes that scan marker columns during recovery; 0 = one per CPU core.
        "recovery_processes": 0,
    },
    "ingest": {
        # Address the producer-facing front binds (submit, status, cancel).
        "bind": "tcp://127.0.0.1:7710",
        # Tokeniser processes behind the front.
        "processes": 1,
        # Largest producer message accepted, in bytes (64 MiB).
        "max_message_bytes": 64 * 1024 * 1024,
        # Items per submit chunk; a chunk is acknowledged once all of it is durable.
        "chunk_items": 4096,
        # Seconds a chunk may take inside the broker before it is failed (retryable)
        # and writers drop what is left of it.
        "chunk_timeout_s": 60.0,
        # Chunks the front works on at once, all producers together; while full it
        # reads no more requests (they wait in the socket: backpressure).
        "max_chunks_in_flight": 64,
        # Chunks one producer connection may have in flight; more are refused with a
        # retryable CHUNK_ERROR, so one producer cannot take the whole front.
        "producer_chunks_in_flight": 16,
        # Bytes of chunks the front holds in flight, all producers together, and for one
        # producer connection; a chunk past either is refused with a retryable CHUNK_ERROR
        # (a connection holding nothing may always send one chunk).
        "max_inflight_bytes": 1024 * 1024 * 1024,
        "producer_inflight_bytes": 256 * 1024 * 1024,
        # Connections to ingest.bind, all peers together, and from one address; one more is
        # cut at once. With max_message_bytes they bound what libzmq buffers before the
        # front sees a message: docs/wire.md, "Limits on each port".
        "max_connections": 128,
        "max_peer_connections": 32,  # ten or twenty local `submit` runs at once are usual
        # Parts one request line may fan out to (an `input`/`prompt` list times `n`): OpenAI's
        # 2,048 inputs per embeddings request. docs/input-format.md, "Lines with several parts".
        "max_inputs_per_line": 2048,
        # Prompt tokens of one line's parts together; a line beyond it is rejected.
        "max_line_tokens": 1024 * 1024,
    },
    "router": {
        # Router processes (assign model, shape and lane to each item).
        "processes": 1,
    },
    "writers": {
        # Segment writer processes.
        "processes": 1,
        # Group-commit window: appends arriving within it share one fsync; 0 = no wait.
        "flush_ms": 2.0,
        # Drop the pages of appended slots from the page cache once they are on disk.
        # Saves the writer most of its kernel time where fresh page-cache pages are
        # costly (VMs); dispatch then reads those slots from disk.
        "drop_synced_pages": True,
    },
    "dispatch": {
        # Address GPU workers connect to for work and results.
        "bind": "tcp://127.0.0.1:7711",
        # Stateless liveness port (answered by the supervisor): broker up, epoch, recovered.
        "heartbeat_bind": "tcp://127.0.0.1:7712",
        # A dispatched item not finished or renewed within this long is reclaimed.
        "lease_s": 300.0,
        # A worker session silent for this long is declared gone.
        "session_timeout_s": 30.0,
        # Reclaims before an item is retired with an error result (dead-lettered).
        "max_attempts": 3,
        # Workers report what they hold (renewing its leases) this often.
        "report_s": 1.0,
        # After a start, work queued before it waits this long for workers that still
        # hold some of it to re-register (invariant 8); work queued later goes at once.
        "reregister_grace_s": 5.0,
        # Batches one worker session may hold at once.
        "session_max_batches": 64,
        # A session holding batches whose results do not come for this many times its own
        # measured batch time is stalled: those batches are reclaimed and it gets no new
        # work until results come again; 0 = no such watch.
        "stall_batch_multiple": 20.0,
        # ... but never sooner than this (covers a session not measured yet, a slow batch).
        "stall_min_s": 300.0,
        # The demand signal (fabric_workers_needed): work without a deadline should be
        # done within this many seconds (docs/dispatch.md, Demand and deadlines).
        "demand_horizon_s": 300.0,
        # The dispatch file is compacted to the live leases once it is over this size and
        # over three quarters of it is resolved batches (1 MiB).
        "compact_min_bytes": 1024 * 1024,
        # Largest message accepted from a worker (RESULTS, REPORT, ...), in bytes (64 MiB);
        # a peer that sends more is disconnected.
        "max_message_bytes": 64 * 1024 * 1024,
    },
    "completion": {
        # Address results are delivered to clients and sinks from.
        "bind": "tcp://127.0.0.1:7713",
        # Completion processes (persist results, then tombstone inputs); one owns all
        # tombstones, so only 1 is supported.
        "processes": 1,
        # Tombstones (retire markers) are flushed about this often.
        "tombstone_flush_ms": 100.0,
        # Delivered results are kept this long (7 days), then removed; their jobs expire.
        "results_retention_s": 7 * 86400.0,
        # Results per page sent to a results client.
        "page_items": 4096,
        # Largest request accepted from a results client, in bytes (1 MiB); a peer that
        # sends more is disconnected.
        "max_message_bytes": 1024 * 1024,
        # The reuse index (`submit --reuse`, docs/completion.md "Result reuse") keeps a
        # stored result this long after its data file was last written (30 days) ...
        "reuse_retention_s": 30 * 86400.0,
        # ... and its data files within this many bytes (16 GiB), the oldest evicted first.
        "reuse_max_bytes": 16 * 1024**3,
    },
    "vectors": {
        # Address of the vector shard manager: searches, reads and stats from users.
        "bind": "tcp://127.0.0.1:7714",
        # Appended rows become durable (and their results delivered) about this often.
        "flush_ms": 100.0,
        # A shard is sealed (immutable) and the next one started at this size (1 GiB).
        "shard_bytes": 1024 * 1024 * 1024,
        # How new stores keep vectors: "float32", or "float16" for half the disk.
        "dtype": "float32",
        # Rows scored at once by a search: bounds its memory (rows x dim x 4 bytes).
        "search_block_rows": 65536,
        # Results the sink asks completion for at once (per job page).
        "page_items": 16384,
    },
    "collector": {
        # The segment collector looks for fully retired files this often.
        "interval_s": 5.0,
    },
    # One [workers] table, or one [[workers]] table per model served by local workers: each
    # takes the keys below, with `count` (default 1) in place of `local` and `model` required.
    "workers": {
        # Worker processes the supervisor starts on this host; 0 = remote workers only.
        "local": 1,
        # Model the local workers serve; "" = the first [[models]] table.
        "model": "",
        # Engine of the local workers; "" = the model's own engine.
        "engine": "",
        # Engine options of the local workers, passed to the engine as keyword arguments,
        # e.g. {tokens_per_s = 5000.0} for `simulated` or {threads = 2} for `minilm`.
        "options": {},
        # Tokens per second of the simulated engine (a stand-in for a GPU).
        "simulated_tokens_per_s": 200000.0,
        # Largest batch a worker asks for, in items and in tokens (items x lane).
        "batch_items": 256,
        "batch_tokens": 262144,
        # Batches a worker keeps queued ahead of its engine.
        "prefetch": 4,
        # A worker sizes its requests so a batch takes its engine about this long (it
        # measures the engine's tokens/s); 0 = always ask for batch_items / batch_tokens.
        "target_batch_s": 0.2,
        # On SIGTERM a worker finishes what it can within this long, then hands the rest back.
        "drain_s": 30.0,
        # A batch still running after this long means a hung engine: the worker hands back
        # what it holds (the hung batch counts an attempt) and exits; 0 = no watchdog.
        "batch_timeout_s": 600.0,
    },
    "supervisor": {
        # Wait before restarting a stage that died.
        "restart_backoff_s": 0.5,
        # Restarts of one stage allowed within restart_window_s before the broker stops.
        "max_restarts": 5,
        # Sliding window over which max_restarts is counted.
        "restart_window_s": 60.0,
        # On shutdown, a stage still running this long after SIGTERM gets SIGKILL.
        "stop_timeout_s": 30.0,
    },
    "metrics": {
        # HOST:PORT where the supervisor serves Prometheus metrics over HTTP (GET /metrics);
        # "" = no metrics endpoint (docs/metrics.md lists what it serves).
        "bind": "127.0.0.1:7719",
        # Stages send their statistics to the supervisor this often.
        "interval_s": 1.0,
    },
    "api": {
        # Run the OpenAI-compatible HTTP API stage (api/, docs/http-api.md). Off by default,
        # so private brokers (tests, `run.py batch`, the demo) never contend for its port.
        "enabled": False,
        # HOST:PORT the HTTP API listens on; beyond loopback it requires keys_file.
        "bind": "127.0.0.1:8000",
        # HTTP server processes sharing the port (SO_REUSEPORT); api-0 also drives batches.
        "processes": 1,
        # File of API keys: one "SHA256-HEX-OF-KEY OWNER" per line; "" = no keys (loopback only).
        "keys_file": "",
        # Uploaded input files are deleted this long after upload (OpenAI: 30 days).
        "input_file_expiry_s": 30 * 24 * 3600.0,
        # Largest upload accepted, in bytes (8 GiB).
        "max_upload_bytes": 8 * 1024 * 1024 * 1024,
        # Longest request line and headers of one request, in bytes; longer: 431.
        "max_header_bytes": 64 * 1024,
        # Connections open at once, per api process; one more is answered 503 and closed.
        "max_connections": 512,
        # A request's line and headers must arrive within this long of its first byte (of a
        # new connection opening); later: 408 and closed (slow or stalled clients).
        "request_head_timeout_s": 20.0,
        # An idle connection is closed this long after its last response.
        "keep_alive_timeout_s": 15.0,
        # An event not answered 2xx this long after its batch ended is given up (OpenAI: 72 h).
        "webhook_give_up_s": 72 * 3600.0,
        # One POST of an event waits this long for the receiver's answer.
        "webhook_timeout_s": 10.0,
        # Hosts beyond loopback that a receiver's URL may name (names or addresses, as
        # written in the URL); [] = loopback receivers only.
        "webhook_hosts": [],
        # [[api.webhooks]] tables: where a batch's end is POSTed, per owner (docs/http-api.md,
        # "Webhooks"): owner (a keys_file owner, or "local" without keys), url, secret_file (a
        # file holding the whsec_ secret), allow_batch_url (metadata fabric_webhook_url may
        # name another receiver for one batch; default false).
        "webhooks": [],
    },
    "security": {
        # Path of the broker's secret key file (NAME.key_secret from `run.py keys new`);
        # set, every ZeroMQ port the broker binds needs CURVE; "" = no authentication.
        "server_key": "",
        # Directory of the public keys (*.key) of producers, workers and clients allowed
        # to connect; required with server_key; read again when its files change.
        "authorized_keys": "",
        # Serve anyway when a port listens beyond loopback without CURVE (or the metrics
        # HTTP endpoint does): a WARNING per exposed address instead of a refusal.
        "allow_insecure": False,
        # Clients (run.py commands, workers): this client's secret key file;
        # "" = server_key (a client on the broker host uses the broker's own key).
        "client_key": "",
        # Clients: the broker's public key file (NAME.key); "" = the public half of server_key.
        "server_public_key": "",
    },
    # Ray fleets (`run.py fleet`, docs/scaling.md): none unless the file has [[fleet]] tables,
    # each with the keys of FLEET_DEFAULTS below.
    "fleet": [],
    # Models served when the file has no [[models]] table.
    "models": [
        {"name": "minilm", "engine": "minilm"},
    ],
}

# The keys of one [[models]] table.
MODEL_DEFAULTS: Final[dict[str, Any]] = {
    # What input lines name in body.model: 1-64 of letters, digits, '/', ':', '.', '_' and '-'
    # (pipeline/store/model_names.py), e.g. "meta-llama/Llama-3.1-8B-Instruct".
    "name": REQUIRED,
    # Engine that runs the model: a key of ENGINE_ENDPOINTS.
    "engine": REQUIRED,
    # Path of the tokenizer.json used at ingest for text input; "" = token ids only.
    "tokenizer": "",
    # Longest prompt accepted, in tokens; must fit the largest lane.
    "max_tokens": 32768,
    # Token ids accepted: 0 .. vocab_size - 1 (a larger id is refused per line at ingest:
    # token_out_of_range). 0 = the tokenizer's vocabulary size when `tokenizer` is set, else
    # the engine's own (ENGINE_VOCAB_SIZE), else no limit at ingest.
    "vocab_size": 0,
    # OpenAI Batch `url` values this model accepts; default: its engine's list below.
    "endpoints": BY_ENGINE,
    # Other names input lines may give the model (e.g. "gpt-4o-mini"), by the same rule; each
    # unique across every model's names and aliases. The output's `model` is the name the line
    # used; everything else (segments, workers, metrics) knows the model by `name`.
    "aliases": [],
    # What the model's weights are, declared by the operator (a Hugging Face revision, a
    # digest, a date): part of the model fingerprint result reuse keys on. "" = the engine's
    # pinned weights where it pins them (minilm, transformers), else the model is not reused.
    "revision": "",
}

# The keys of one [[fleet]] table (`run.py fleet --ray ADDRESS`, gpu workers as Ray actors;
# docs/scaling.md): these, and every key of a [[workers]] table but `count` (engine, options,
# batch_items, drain_s, ...), with the same defaults.
FLEET_DEFAULTS: Final[dict[str, Any]] = {
    # The model the fleet's actors serve: a [[models]] name, one [[fleet]] table per model.
    "model": REQUIRED,
    # Fewest and most actors; between them the fleet follows the broker's workers_needed.
    "min": 0,
    "max": 1,
    # Ray resources of each actor (Ray places it on a node that has them).
    "num_gpus": 0.0,
    "num_cpus": 1.0,
    # Ray's accelerator type of a GPU actor, e.g. "H100" or "A10G"; "" = any.
    "accelerator_type": "",
}

_EMBEDDINGS: Final = ["/v1/embeddings"]
_COMPLETIONS: Final = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]

# Every engine, and the endpoints a model on it serves unless it sets `endpoints`.
ENGINE_ENDPOINTS: Final[dict[str, list[str]]] = {
    "echo": _COMPLETIONS,
    "simulated": _COMPLETIONS,
    "minilm": _EMBEDDINGS,
    "transformers": _COMPLETIONS,
    "vllm": _COMPLETIONS,
    "openai": [*_EMBEDDINGS, *_COMPLETIONS],  # whatever the server behind it serves
}

# Engines that fix their model, and its vocabulary size: a model on one of them with neither
# `tokenizer` nor `vocab_size` still has its token ids checked at ingest. echo and simulated
# take any id; transformers and vllm load a model named at the worker, unknown here.
ENGINE_VOCAB_SIZE: Final[dict[str, int]] = {"minilm": 30522}

# The weights an engine fixes, for the model fingerprint that result reuse keys on (a model's
# `revision` is used instead when set). minilm loads only its pinned file (gpu/engines/minilm.py
# checks this sha256); echo and simulated compute their output from the input alone.
# transformers and vllm load what their workers are told: the front digests it where it can
# (ingest/weights_digest.py: SmolLM2's pinned GGUF, a local file or directory); openai needs a
# `revision`.
MINILM_SHA256: Final = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
SMOLLM2_SHA256: Final = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENGINE_PINNED_WEIGHTS: Final[dict[str, str]] = {
    "minilm": f"sha256:{MINILM_SHA256}",
    "echo": "builtin",
    "simulated": "builtin",
}

# Every endpoint a model may list.
ENDPOINTS: Final[tuple[str, ...]] = (*_EMBEDDINGS, *_COMPLETIONS)

# The plain sections of DEFAULTS, in file order (everything except the lists of tables).
SECTIONS: Final[tuple[str, ...]] = tuple(k for k in DEFAULTS if k not in ("fleet", "models"))
