"""Every port a broker listens on, in one table, and the one reading of an address.

| setting                   | protocol | for                         | on when          | authenticated by     |
|---------------------------|----------|-----------------------------|------------------|----------------------|
| `ingest.bind`             | zmq      | producers (submit)          | always           | `security.server_key` (CURVE) |
| `dispatch.bind`           | zmq      | workers (run.py worker)     | always           | `security.server_key` |
| `dispatch.heartbeat_bind` | zmq      | worker heartbeats           | always           | `security.server_key` |
| `completion.bind`         | zmq      | results, status JOB, cancel | always           | `security.server_key` |
| `vectors.bind`            | zmq      | vector search and export    | always           | `security.server_key` |
| `metrics.bind`            | http     | Prometheus metrics          | set (not "")     | nothing              |
| `api.bind`                | http     | the OpenAI Batch API        | `api.enabled`    | `api.keys_file`      |

Three start-up steps read it: the check that a bind beyond loopback has
something authenticating it (pipeline/transport/security.py), the check that each port
can be bound (pipeline/process/preflight.py) and the banner that lists them
(pipeline/process/announce.py). A ZeroMQ bind is `tcp://HOST:PORT` or `ipc://PATH`;
an HTTP one is `HOST:PORT`. tests/test_config.py checks that every `bind`
setting of config/defaults.py has its row here.
"""

from __future__ import annotations

from dataclasses import dataclass

WILDCARD_HOSTS = ("*", "", "0.0.0.0", "::")  # every interface
LOOPBACK_HOST = "127.0.0.1"  # where a client on this host reaches a wildcard bind


@dataclass(frozen=True)
class Bind:
    """One listening address of the broker, named by its dotted config key."""

    setting: str
    protocol: str  # "zmq" or "http"
    purpose: str  # what it is for, in the start-up banner
    switch: str = ""  # the boolean setting that turns it on; "" = on whenever it is set
    guard: str = ""  # the setting that, set, makes it authenticate clients; "" = nothing does


_CURVE = "security.server_key"

BINDS: tuple[Bind, ...] = (
    Bind("ingest.bind", "zmq", "producers (submit)", guard=_CURVE),
    Bind("dispatch.bind", "zmq", "workers (run.py worker)", guard=_CURVE),
    Bind("dispatch.heartbeat_bind", "zmq", "worker heartbeats", guard=_CURVE),
    Bind("completion.bind", "zmq", "results, status JOB, cancel", guard=_CURVE),
    Bind("vectors.bind", "zmq", "vector search and export", guard=_CURVE),
    Bind("metrics.bind", "http", "Prometheus metrics (HTTP)"),
    Bind(
        "api.bind", "http", "OpenAI Batch API (HTTP)", switch="api.enabled", guard="api.keys_file"
    ),
)


def setting(settings, dotted: str):
    """The value of a dotted config key ("api.bind") in a `Settings`."""
    section, key = dotted.split(".")
    return getattr(getattr(settings, section), key)


def bound(settings) -> list[tuple[Bind, str]]:
    """(bind, address) of every address this broker listens on, as configured, in table order."""
    found = []
    for bind in BINDS:
        address = setting(settings, bind.setting)
        if address and (not bind.switch or setting(settings, bind.switch)):
            found.append((bind, address))
    return found


def guarded(settings, bind: Bind) -> bool:
    """True when `bind` authenticates its clients with this configuration."""
    return bool(bind.guard) and bool(setting(settings, bind.guard))


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "tcp://HOST:PORT" (ZeroMQ) or "HOST:PORT" (HTTP), an IPv6 host without
    its brackets; None for an ipc:// path and for what names no port."""
    if "://" in address and not address.startswith("tcp://"):
        return None
    host, colon, port = address.removeprefix("tcp://").rpartition(":")
    if not colon or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def is_wildcard(host: str) -> bool:
    """True for a host that means every interface ("*", "0.0.0.0", "::", empty)."""
    return host in WILDCARD_HOSTS
