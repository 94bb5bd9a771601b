"""The stage processes a broker runs, the rings between them, and their internal sockets.

The stage classes themselves are named by the stage table on the top floor
(assembly/stages.py); this module knows the stages by name and count only.

| stage       | count                | reads                                   | writes                                |
|-------------|----------------------|-----------------------------------------|---------------------------------------|
| `front`     | 1                    | producers (ingest.bind), `front` socket  | rings front->router, `tokenize` socket |
| `tokenizer` | ingest.processes     | `tokenize` socket                       | rings tokenizer->router, `front`       |
| `router`    | router.processes     | its rings, `router-<r>` socket           | rings router->writer                  |
| `writer`    | writers.processes    | its rings, `writer-<w>` socket           | segments, `front` socket (acks), `dispatch` socket (APPENDED) |
| `worker`    | workers.local, or each [[workers]] count | dispatch.bind (a client, like any worker) | dispatch.bind                          |
| `dispatch`  | 1                    | segments, dispatch.bind, `dispatch` socket | dispatch.bind, `completion` socket     |
| `completion`| 1                    | `completion` socket, completion.bind     | completion log, input markers, `dispatch` socket |
| `api`       | api.processes if api.enabled | HTTP clients (api.bind), its files under `api/` | the front (as a producer), completion.bind (as a results client) |
| `vectors`   | 1                    | vector stores (recovered first), vectors.bind, completion.bind (as a sink) | vector shards |

Stages are listed front first: the supervisor stops them in this order, so
work already accepted drains downstream, and local workers hand back what
they hold while dispatch and completion still run. Internal sockets are ipc endpoints
under a short run directory derived from the data dir (ipc paths are
limited to 107 bytes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.transport.binds import LOOPBACK_HOST, host_port, is_wildcard
from pipeline.transport.ring_names import ring_name

RING_BYTES = (
    64 << 20
)  # per ring; records are at most pipeline.transport.ring_records.MAX_RECORD_BYTES


class Placed(Protocol):
    """Settings that say where the data dir is: the whole config, or any stage's own
    (config/stage_settings.py)."""

    @property
    def data_path(self) -> Path: ...


class _Counted(Protocol):
    @property
    def processes(self) -> int: ...


class Wired(Placed, Protocol):
    """Settings that say how many processes the rings join: the whole config, or the front's,
    a tokenizer's, a router's or a writer's own."""

    @property
    def ingest(self) -> _Counted: ...
    @property
    def router(self) -> _Counted: ...
    @property
    def writers(self) -> _Counted: ...


@dataclass(frozen=True)
class RingSpec:
    name: str
    src: str  # stage label, e.g. "router-0"
    dst: str


def run_dir_path(data_path: Path) -> Path:
    """Where the ipc sockets of the broker on `data_path` are: a short directory, unique to
    the data dir, under the temporary directory."""
    resolved = os.path.realpath(data_path)
    digest = hashlib.blake2b(resolved.encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"fabric-{digest}"


def run_dir(settings: Placed) -> Path:
    """The directory for ipc sockets (`run_dir_path`), made if missing."""
    path = run_dir_path(settings.data_path)
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def remove_run_dir(settings: Placed) -> None:
    """Remove the ipc sockets' directory: a broker that stopped cleanly leaves none behind
    (one killed leaves it, and its next start on the data dir uses it again)."""
    shutil.rmtree(run_dir_path(settings.data_path), ignore_errors=True)


def client_address(bind: str) -> str:
    """A bind address as a client on this host connects to it (tcp://*:P -> tcp://127.0.0.1:P)."""
    target = host_port(bind) if bind.startswith("tcp://") else None
    if target is not None and is_wildcard(target[0]):
        return f"tcp://{LOOPBACK_HOST}:{target[1]}"
    return bind


def internal_address(settings: Placed, endpoint: str) -> str:
    """`ipc://` address of an internal socket: front, tokenize, router-<r>, writer-<w>."""
    return f"ipc://{run_dir(settings) / endpoint}.ipc"


def stage_label(name: str, index: int) -> str:
    """A stage process's label, as logs, metrics, rings, sockets and supervisor.json name it:
    "writer-0"."""
    return f"{name}-{index}"


def ring_specs(settings: Wired) -> list[RingSpec]:
    data = settings.data_path
    rings = []
    for r in range(settings.router.processes):
        router = stage_label("router", r)
        rings.append(RingSpec(ring_name(data, "front", "router", r), "front-0", router))
        for t in range(settings.ingest.processes):
            n = t * settings.router.processes + r
            rings.append(
                RingSpec(
                    ring_name(data, "tokenizer", "router", n), stage_label("tokenizer", t), router
                )
            )
        for w in range(settings.writers.processes):
            n = r * settings.writers.processes + w
            rings.append(
                RingSpec(ring_name(data, "router", "writer", n), router, stage_label("writer", w))
            )
    return rings


def rings_from(settings: Wired, label: str) -> list[RingSpec]:
    """Rings a stage writes, ordered by destination index."""
    return [r for r in ring_specs(settings) if r.src == label]


def rings_to(settings: Wired, label: str) -> list[RingSpec]:
    """Rings a stage reads."""
    return [r for r in ring_specs(settings) if r.dst == label]
