"""CURVE authentication of the broker's ZeroMQ ports, and which binds may face the network.

Keys are ZeroMQ certificate files, made by `python run.py keys new NAME`
(pyzmq's `zmq.auth` format): `NAME.key` holds the public key, `NAME.key_secret`
the public and the secret key (mode 0600).

| side   | what                   | taken from (first that is set)                                      |
|--------|------------------------|---------------------------------------------------------------------|
| broker | its key pair           | `security.server_key`                                               |
| broker | who may connect        | every `*.key` in `security.authorized_keys`, and the broker's own key |
| client | its key pair           | `--key`, `security.client_key`, `security.server_key`                |
| client | the broker's public key | `--server-key`, `security.server_public_key`, `security.server_key`  |

With a server key every port the broker binds over TCP (ingest, dispatch,
heartbeat, completion, vectors) is a CURVE server: traffic is encrypted, and
each process that binds one runs a ZAP authenticator (`ServerGate`) that lets
a client finish its handshake only if its public key is allowed. A refused
client gets no answer at all, and the stage never sees its messages; the
refusal is logged with the peer's address and the key's first 8 z85
characters (at most once a minute per key). The
authorized directory is listed again whenever its files change, so adding or
removing a key takes effect for new connections without a restart. Stages
that are clients of their own broker (local workers, the vector sink) use
the broker's key pair. Internal ipc sockets (a 0700 run directory) and the
metrics endpoint (plain HTTP) have no CURVE.

`check_exposure` refuses, at start-up, a bind that listens beyond loopback
with nothing authenticating it (the table in pipeline/transport/binds.py: every ZeroMQ
bind without a server key, the metrics endpoint always, the HTTP API without
`api.keys_file`), unless `security.allow_insecure` is set.
`loose_authorized_keys` gives the start-up warnings for an authorized_keys
directory (or key in it) that group or others may write.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from pipeline.core.errors import ConfigError, FabricError
from pipeline.transport.binds import Bind, bound, guarded, host_port

log = logging.getLogger("fabric.security")
KEY_NAME = re.compile(r"[A-Za-z0-9._-]+")
DENIED_LOG_EVERY_S = 60.0  # a refused key is logged at most this often (clients retry fast)
KEY_PREFIX_CHARS = 8  # of a refused client's z85 public key, in the log
HOW_TO = "docs/operations.md, Keys and authentication"
# What to do about a bind beyond loopback that nothing authenticates, by what would (binds.py).
EXPOSURE_FIX = {
    "security.server_key": (
        "set security.server_key and security.authorized_keys to require CURVE keys "
        f"({HOW_TO}), or bind to 127.0.0.1"
    ),
    "api.keys_file": (
        "set api.keys_file to require API keys (docs/http-api.md), or bind to 127.0.0.1"
    ),
    "": (
        "it is plain HTTP with no authentication: bind it to 127.0.0.1 (scrape metrics "
        'through a tunnel or a local agent) or set it to ""'
    ),
}


# ---- key files ------------------------------------------------------------------------
def read_public_key(path: str, key: str) -> bytes:
    """The (z85) public key in the certificate file at `path`, named in errors by `key`."""
    return _read(path, key)[0]


def read_key_pair(path: str, key: str) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file; ConfigError if it holds no secret key."""
    public, secret = _read(path, key)
    if secret is None:
        raise ConfigError(
            f"{key} = {path!r} holds only a public key; give the NAME.key_secret file "
            f"made by `python run.py keys new NAME` ({HOW_TO})"
        )
    return public, secret


def _read(path: str, key: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"{key} = {path!r}: no such key file (looked for {Path(path).absolute()}); make one "
            f"with `python run.py keys new NAME` ({HOW_TO})"
        )
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ConfigError(
            f"{key} = {path!r}: cannot read the key file ({exc.strerror or exc}); run as the "
            f"user that owns it"
        ) from None
    except ValueError:
        raise ConfigError(
            f"{key} = {path!r} is not a ZeroMQ key file (no public-key line); make one with "
            f"`python run.py keys new NAME`"
        ) from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise ConfigError(f"{key} = {path!r} holds a key that is not 40 z85 characters")
    return public, secret


def new_key_pair(name: str, directory: Path) -> tuple[Path, Path]:
    """Write `directory`/NAME.key (public, 0644) and NAME.key_secret (0600); never overwrite."""
    if not KEY_NAME.fullmatch(name):
        raise FabricError(f"key name {name!r} is not letters, digits, '.', '_' and '-'")
    public = directory / f"{name}.key"
    secret = directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FabricError(
                f"{path} already exists; choose another NAME or remove the old pair first "
                f"(a key in use is replaced by rotating: {HOW_TO})"
            )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    public.chmod(0o644)
    return public, secret


# ---- clients --------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientCurve:
    """A client's key pair and the broker's public key (all z85)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` a CURVE client; call before `connect`."""
        socket.curve_serverkey = self.server
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret


def secure_client(socket: zmq.Socket, curve: ClientCurve | None) -> None:
    """Apply `curve` to `socket` (before `connect`); None leaves it a plain socket."""
    if curve is not None:
        curve.apply(socket)


def client_curve(
    security, key: str | None = None, server_key: str | None = None
) -> ClientCurve | None:
    """The CURVE keys a client uses, or None when neither side's key is configured.

    `security` is a `SecuritySettings`; `key` (--key) and `server_key`
    (--server-key) override its paths. Raises ConfigError when only one of
    the client's key and the broker's public key is known, or a file is bad.
    """
    key_path, key_name = _first(
        (key, "--key"),
        (security.client_key, "security.client_key"),
        (security.server_key, "security.server_key"),
    )
    server_path, server_name = _first(
        (server_key, "--server-key"),
        (security.server_public_key, "security.server_public_key"),
        (security.server_key, "security.server_key"),
    )
    if not key_path and not server_path:
        return None
    if not server_path:
        raise ConfigError(
            f"{key_name} = {key_path!r} is set but the broker's public key is not; pass "
            f"--server-key BROKER.key or set security.server_public_key ({HOW_TO})"
        )
    if not key_path:
        raise ConfigError(
            f"{server_name} = {server_path!r} names the broker's key but this client has none; "
            f"pass --key NAME.key_secret or set security.client_key (make one with "
            f"`python run.py keys new NAME`, then authorize NAME.key on the broker: {HOW_TO})"
        )
    public, secret = read_key_pair(key_path, key_name)
    return ClientCurve(public, secret, read_public_key(server_path, server_name))


def internal_curve(settings) -> ClientCurve | None:
    """Keys for a stage that is a client of its own broker: the broker's key pair."""
    if not settings.security.curve:
        return None
    public, secret = read_key_pair(settings.security.server_key, "security.server_key")
    return ClientCurve(public, secret, public)


def _first(*candidates: tuple[str | None, str]) -> tuple[str, str]:
    for value, name in candidates:
        if value:
            return value, name
    return "", ""


# ---- the broker -----------------------------------------------------------------------
@dataclass(frozen=True)
class ServerKeys:
    """The broker's key pair and where the allowed client keys are."""

    public: bytes
    secret: bytes
    authorized: Path

    @classmethod
    def load(cls, security) -> ServerKeys | None:
        """Read `security.server_key`; None without one. ConfigError on a bad file or directory."""
        if not security.curve:
            return None
        public, secret = read_key_pair(security.server_key, "security.server_key")
        authorized = Path(security.authorized_keys)
        if not authorized.is_dir():
            raise ConfigError(
                f"security.authorized_keys = {security.authorized_keys!r} is not a directory "
                f"(looked for {authorized.absolute()}); create it and copy the *.key files of "
                f"allowed clients into it ({HOW_TO})"
            )
        return cls(public, secret, authorized)


class AuthorizedKeys:
    """ZAP credentials provider: the broker's own key and every `*.key` in one directory.

    The directory is listed on each handshake and its files read again only
    when a name, size or mtime changed, so keys can be added and removed
    while the broker runs.
    """

    def __init__(self, directory: Path, own: bytes) -> None:
        self.directory = directory
        self.own = own
        self._signature: tuple = ()
        self._keys: frozenset[bytes] = frozenset()
        self._denied_at: dict[bytes, float] = {}
        self.peer = (
            "?"  # the address of the handshake being judged (set by pipeline/transport/zap_gate.py)
        )

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.own or key in self.keys():
            return True
        now = time.monotonic()
        if now - self._denied_at.get(key, -DENIED_LOG_EVERY_S) >= DENIED_LOG_EVERY_S:
            self._denied_at[key] = now
            log.warning(
                "refused a CURVE client at %s with key %s...: not in %s (copy its public "
                "NAME.key there to let it in)",
                self.peer,
                key[:KEY_PREFIX_CHARS].decode(errors="replace"),
                self.directory,
            )
        return False

    def keys(self) -> frozenset[bytes]:
        try:
            entries = sorted(
                (e.name, e.stat().st_size, e.stat().st_mtime_ns)
                for e in os.scandir(self.directory)
                if e.name.endswith(".key")
            )
        except OSError as exc:
            log.error("cannot list authorized keys in %s: %s", self.directory, exc)
            return self._keys
        signature = tuple(entries)
        if signature != self._signature:
            keys = set()
            for name, _, _ in entries:
                try:
                    keys.add(zmq.auth.load_certificate(self.directory / name)[0])
                except (OSError, ValueError) as exc:
                    log.warning("authorized key %s skipped: %s", self.directory / name, exc)
            self._keys, self._signature = frozenset(keys), signature
            log.info("%d authorized key(s) in %s", len(keys), self.directory)
        return self._keys


def loose_authorized_keys(security) -> list[str]:
    """Warnings for an authorized_keys directory (or a key in it) that group or others may
    write: whoever can write there can let any client in."""
    if not security.curve or not security.authorized_keys:
        return []
    directory = Path(security.authorized_keys)
    warnings = []
    for path in [directory, *sorted(directory.glob("*.key"))]:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            continue
        if mode & 0o022:
            warnings.append(
                f"security.authorized_keys: {path} is writable by group or others (mode "
                f"{mode:o}): anyone who can write there can authorize a key; chmod go-w it"
            )
    return warnings


class ServerGate:
    """The listening side of one process: CURVE server options and its ZAP authenticator.

    Create it on the context of the sockets it will secure, call `secure`
    on each before `bind`, and `close` it before the context is terminated.
    Without a server key it does nothing.
    """

    def __init__(self, context: zmq.Context, security) -> None:
        self.keys = ServerKeys.load(security)
        self.authenticator = None  # a ZapGate while it serves
        if self.keys is None:
            return
        authorized = AuthorizedKeys(self.keys.authorized, self.keys.public)
        from pipeline.transport.zap_gate import ZapGate  # asyncio with it: only where CURVE serves

        self.authenticator = ZapGate(context, authorized)
        self.authenticator.configure_curve_callback("*", authorized)
        self.authenticator.start()  # binds the context's ZAP endpoint before any CURVE bind

    def secure(self, socket: zmq.Socket) -> None:
        """Make `socket` a CURVE server (before `bind`); nothing without a server key."""
        if self.keys is None:
            return
        socket.curve_server = True
        socket.curve_publickey = self.keys.public
        socket.curve_secretkey = self.keys.secret

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


# ---- which binds face the network ------------------------------------------------------
def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; False for wildcards, names and interfaces."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed_binds(settings) -> list[tuple[Bind, str]]:
    """(bind, address) of every bind reachable beyond loopback with nothing guarding it."""
    exposed = []
    for bind, address in bound(settings):  # ipc:// paths name no host: they are files
        target = host_port(address)
        if target is not None and not is_loopback(target[0]) and not guarded(settings, bind):
            exposed.append((bind, address))
    return exposed


def check_exposure(settings) -> list[str]:
    """Refuse (ConfigError) an unguarded bind beyond loopback; the warnings to log if allowed."""
    exposed = exposed_binds(settings)
    if exposed and not settings.security.allow_insecure:
        bind, address = exposed[0]
        others = f" (and {len(exposed) - 1} more)" if len(exposed) > 1 else ""
        raise ConfigError(
            f"{settings.source}: {bind.setting} = {address!r} listens beyond loopback without "
            f"authentication{others}; {EXPOSURE_FIX[bind.guard]}; or set "
            f"security.allow_insecure = true to serve it anyway"
        )
    return [
        f"security.allow_insecure = true: {bind.setting} = {address!r} is reachable beyond "
        f"loopback without authentication; anyone who can reach it can use it"
        for bind, address in exposed
    ]


def loose_permissions(path: str) -> int | None:
    """The mode of `path` if group or others may read it, else None."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    return mode if mode & 0o077 else None
