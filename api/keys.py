"""API keys and their owners: `Authorization: Bearer KEY` -> owner.

The keys file (`[api] keys_file`) holds one line per key, the SHA-256 of the
key in hex and the owner's name, blank lines and `#` comments allowed:

    # printf %s "$KEY" | sha256sum
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 team-a

Only hashes are stored, so the file leaks no key. It is read again when its
modification time changes (adding or removing a key needs no restart).
Without a keys file every caller is the owner `local` (the stage then binds
only to loopback: pipeline.transport.security.exposed_binds refuses anything else).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
from pathlib import Path

from api.errors import unauthorized
from pipeline.core.errors import ConfigError

LOCAL_OWNER = "local"
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_HEX = re.compile(r"[0-9a-f]{64}\Z")


def key_hash(key: str) -> str:
    """The hex SHA-256 of a key, as the keys file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: Path) -> dict[str, str]:
    """{key hash: owner} from a keys file; ConfigError names the bad line."""
    keys: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"api.keys_file {str(path)!r} cannot be read: {exc.strerror}; create it with one "
            "'SHA256-HEX OWNER' line per key"
        ) from exc
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _HEX.match(parts[0].lower()) or not _OWNER.match(parts[1]):
            raise ConfigError(
                f"api.keys_file {str(path)!r} line {number}: expected 'SHA256-HEX OWNER' (64 hex "
                "digits, then a name of letters, digits, '.', '_' or '-'); make the hash with "
                "printf %s KEY | sha256sum"
            )
        keys[parts[0].lower()] = parts[1]
    return keys


class KeyRing:
    """Who a request's bearer key belongs to."""

    def __init__(self, keys_file: str) -> None:
        self.path = Path(keys_file) if keys_file else None
        self._stamp: tuple[int, int] | None = None
        self._keys: dict[str, str] = {}
        if self.path is not None:
            self._reload()

    def _reload(self) -> None:
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._keys = read_keys(self.path)
            self._stamp = stamp

    def owner(self, authorization: str | None) -> str:
        """The owner of the request's key; ApiError 401 for a missing or unknown key."""
        if self.path is None:
            return LOCAL_OWNER
        if not authorization or not authorization.startswith("Bearer "):
            raise unauthorized(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        with contextlib.suppress(OSError, ConfigError):  # being replaced: keep the last keys
            self._reload()
        digest = key_hash(authorization.removeprefix("Bearer ").strip())
        for known, owner in self._keys.items():
            if hmac.compare_digest(known, digest):
                return owner
        raise unauthorized("Incorrect API key provided.")
