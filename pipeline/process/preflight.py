"""What the broker checks before it says "serving": files named in the config, and ports.

A stage that cannot start (a tokenizer file that is not there, a port
another program holds) would otherwise die at start again and again until
the supervisor gives up, with the cause only in a stage's log. These checks
run in the supervisor, after it took the data dir's lock and before anything
binds or starts; each failure is a ConfigError (exit code 3) that names the
setting, the value and what to do.

| check                 | what                                                          |
|-----------------------|---------------------------------------------------------------|
| files                 | handed in by the composition root (assembly/broker.py): every model's `tokenizer` file exists and loads (and its chat template compiles), as the tokenizer stages will load it |
| ports                 | every TCP port the broker binds (the table in pipeline/transport/binds.py: the ZeroMQ ports, `metrics.bind`, and `api.bind` when `api.enabled`) can be bound now, and no two are one port: bound and closed at once |

A port is free at the check and taken a moment later by someone else is
still possible; the stage that fails then dies at start and the supervisor
prints its last error line (pipeline/process/supervisor.py).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.transport.binds import bound, host_port


def preflight(settings, check_files: Callable[[Any], None] | None = None) -> None:
    """Raise ConfigError naming the first thing that would stop a stage at start:
    `check_files(settings)` (the files the config names, which upper floors load), then ports."""
    if check_files is not None:
        check_files(settings)
    check_ports(settings)


def check_ports(settings) -> None:
    seen: dict[tuple[str, int], str] = {}
    for bind, address in bound(settings):
        target = _probe_target(address)
        if target is None:
            continue
        name = bind.setting
        if target in seen:
            raise ConfigError(
                f"{name} = {address!r} is the same port as {seen[target]}; give each its own port"
            )
        seen[target] = name
        problem = _bind_problem(*target)
        if problem is not None:
            raise ConfigError(
                f"{name} = {address!r}: cannot bind it ({problem}); stop the program that "
                f"holds it (`ss -ltnp | grep :{target[1]}`) or set {name} to a free port"
            )


def _probe_target(address: str) -> tuple[str, int] | None:
    """(host, port) to test, or None for what is not a fixed TCP port (ipc, port 0)."""
    target = host_port(address)
    if target is None or target[1] == 0:
        return None
    host, port = target
    return ("0.0.0.0" if host in ("*", "") else host), port  # ZeroMQ's "*": every IPv4 interface


def _bind_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound now, or None. Closed at once: the stage binds it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"host {host!r} does not resolve: {exc.strerror}"
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(where)
            probe.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the port is already in use"
            return exc.strerror or str(exc)
    return None
