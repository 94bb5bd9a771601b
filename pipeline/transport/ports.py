"""Free loopback ports for a generated config (the demo, `run.py batch`, the tests and the
benchmarks), reserved host-wide until the process that picked them gives them back or ends.

A generated config's ports must stay its broker's for as long as the config is in use, not
only at the moment they are picked: a broker that is killed binds the same ports again when it
restarts, and two programs picking ports on one host (two test suites, `run.py batch` next to
a test run) must never be handed the same one. Three rules make that so:

- Ports come from 20000 up to the kernel's ephemeral range (`EPHEMERAL_RANGE`). The kernel
  hands the ports of that range to outgoing connections and to binds on port 0: one of them
  could take a broker's port while the broker is down, and its restart would fail with
  "address already in use". Only when none of those can be had does the kernel pick.
- Each port picked is reserved in a registry every process on the host reads: a write lock
  (fcntl) on byte PORT of `REGISTRY`, which this process holds until `release_ports` or its
  exit. A picker skips a port another process holds, even while the broker on it is down
  between a kill and its restart. The kernel drops a dead process's locks, so a SIGKILL
  leaves nothing behind; the file itself stays empty.
- A reserved port is bound once, to check that nothing listens on it now (a broker with a
  written config, any other program: those take no part in the registry).

Two other ways were weighed and left. A broker bound to port 0 (`tcp://127.0.0.1:*`), its port
read back from it, gets a new port at each restart, so every client's address goes stale
exactly when a broker is restarted; and its ports are ephemeral ones. A socket held open (with
SO_REUSEPORT) until the broker binds keeps the port only until then: ZeroMQ does not set
SO_REUSEPORT, so the holder must let go before the broker binds, and nothing keeps the port
while a killed broker is down.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import socket
import threading
from collections.abc import Iterable
from pathlib import Path

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"  # the ports outgoing connections get
LOWEST_PORT = 20000  # below are the well-known services' ports
REGISTRY = Path("/tmp/fabric-ports.lock")  # one per host (not $TMPDIR, which may differ)
KERNEL_TRIES = 1000  # port-0 binds before giving up, when no candidate could be had

log = logging.getLogger("fabric.ports")

_lock = threading.Lock()  # over _held and the registry's locks, for this process's threads
_held: set[int] = set()  # the ports this process reserved (its own locks never conflict)
_registry: int | None = None  # the registry's file descriptor, opened at the first pick
_opened = False


def free_loopback_ports(n: int, candidates: Iterable[int] | None = None) -> list[int]:
    """n distinct loopback TCP ports that nothing listens on and no other process on this host
    has reserved, each now reserved by this process (see the module's docstring). They are
    taken from `candidates` (default: random ports from `LOWEST_PORT` up to the ephemeral
    range); the kernel picks (port 0) the rest when none of those can be had."""
    if candidates is None:
        candidates = _below_ephemeral()
    picked: list[int] = []
    with _lock:
        for port in candidates:
            if len(picked) == n:
                break
            if _reserve(port):
                picked.append(port)
        for _ in range(KERNEL_TRIES):
            if len(picked) == n:
                return picked
            port = _kernel_port()
            if _reserve(port):
                picked.append(port)
    release_ports(picked)
    raise OSError(
        f"no free loopback port left for a generated config: {len(picked)} of {n} found "
        f"(see who holds them with `ss -ltnp`, and the locks on {REGISTRY} with `lslocks`)"
    )


def release_ports(ports: Iterable[int]) -> None:
    """Give back ports this process reserved: another process may pick them from now on."""
    with _lock:
        for port in ports:
            if port in _held:
                _held.discard(port)
                if _registry is not None:
                    fcntl.lockf(_registry, fcntl.LOCK_UN, 1, port, os.SEEK_SET)


def reserved_ports() -> frozenset[int]:
    """The ports this process holds reserved."""
    with _lock:
        return frozenset(_held)


def _reserve(port: int) -> bool:
    """Reserve `port` for this process if no process holds it and nothing listens on it."""
    if port in _held:
        return False
    registry = _open_registry()
    if registry is not None:
        try:
            fcntl.lockf(registry, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
        except OSError:  # another process holds it
            return False
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            if registry is not None:
                fcntl.lockf(registry, fcntl.LOCK_UN, 1, port, os.SEEK_SET)
            return False
    _held.add(port)
    return True


def _open_registry() -> int | None:
    """The registry's descriptor, kept open for this process's life (closing any descriptor of
    the file would drop all of this process's locks on it); None where it cannot be opened."""
    global _registry, _opened
    if not _opened:
        _opened = True
        try:
            _registry = _open(REGISTRY)
        except OSError as e:
            log.warning(
                "ports for generated configs are not reserved host-wide (%s cannot be opened: "
                "%s); another program picking ports on this host may pick the same one. Fix: "
                "make %s readable and writable by every user.",
                REGISTRY,
                e.strerror,
                REGISTRY,
            )
            return None
        if os.fstat(_registry).st_uid == os.getuid():
            os.fchmod(_registry, 0o666)  # every user's pickers share it
    return _registry


def _open(path: Path) -> int:
    """Open the registry, made if missing. An existing file is opened without O_CREAT: in a
    sticky /tmp, fs.protected_regular refuses O_CREAT on another user's file."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's locks (fcntl locks belong to a process)."""
    global _lock, _held
    _lock = threading.Lock()
    _held = set()


os.register_at_fork(after_in_child=_forget_after_fork)


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _below_ephemeral(tries: int = 200) -> list[int]:
    """`tries` random ports from LOWEST_PORT to just below the ephemeral range (none if
    unknown)."""
    try:
        low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    if low <= LOWEST_PORT + 1:
        return []
    return random.sample(range(LOWEST_PORT, low), min(tries, low - LOWEST_PORT))
