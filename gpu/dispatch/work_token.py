"""Work tokens: proof that this data dir handed a batch of items to a worker session.

Dispatch hands out each batch with a token, a keyed BLAKE2b MAC (16 bytes,
sent as 32 hex characters) under a secret that belongs to the data dir:

    token = BLAKE2b(key = secret, person = b"fabric-work-1", digest_size = 16)
            over  batch_id (u64 LE) | len(session) (u16 LE) | session (ASCII) | items (ITEM_DTYPE bytes)

`items` are the batch's (segment, slot, seq) descriptors exactly as WORK
carried them. The worker keeps the token and those descriptors (`issued`)
with the batch and returns both with its RESULTS and, for every batch it
still holds, with a WORKER_HELLO's claims (docs/wire.md). Dispatch
recomputes the MAC (one hash per batch, about a microsecond per thousand
items) and takes results or claims only for items inside a batch whose token
verifies for that session. So a process that guesses (segment, slot, seq),
a session claiming work it was never handed, and a worker left over from a
data dir that was removed and made again (another secret) are refused.

| path                          | what                                                   |
|-------------------------------|--------------------------------------------------------|
| `<data_dir>/work-token.key`   | the secret: 64 hex characters and a newline, mode 0600 |

The secret is random, made once with the data dir (written to a temporary
file, synced, linked into place only if no secret is there, the directory
synced) and never replaced: a file that is unreadable or malformed stops
dispatch with an error instead of a silent new secret, which would refuse
every worker's work in flight.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from gpu.work_protocol import ITEM_DTYPE
from pipeline.core.errors import FabricError
from pipeline.store.durable import fsync_dir

SECRET_FILE = "work-token.key"
SECRET_BYTES = 32
TOKEN_BYTES = 16
PERSON = b"fabric-work-1"
MAX_PROOFS = 4096  # tokens one WORKER_HELLO may carry (a worker holds tens of batches)
REFUSED_LOG_EVERY_S = 10.0  # refused results or claims: one log line per kind this often at most


class WorkTokens:
    """Makes and checks work tokens under one data dir's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a work-token secret is {SECRET_BYTES} bytes, not {len(secret)}")
        self._secret = secret

    @classmethod
    def of_data_dir(cls, root: Path) -> WorkTokens:
        """The data dir's secret, made (durably, once) if it has none yet."""
        path = Path(root) / SECRET_FILE
        if not path.exists():
            _create(path)
        try:
            text = path.read_text().strip()
            secret = bytes.fromhex(text)
        except (OSError, ValueError) as exc:
            raise FabricError(
                f"{path}: cannot read the work-token secret ({exc}); if the file is damaged, "
                f"remove it and restart (work handed out before is then refused and done again)"
            ) from None
        if len(secret) != SECRET_BYTES:
            raise FabricError(
                f"{path} holds {len(secret)} bytes, not a {SECRET_BYTES}-byte work-token secret; "
                f"if it is damaged, remove it and restart (work handed out before is then "
                f"refused and done again)"
            )
        return cls(secret)

    def token(self, batch_id: int, session: str, items: np.ndarray) -> str:
        """The token of batch `batch_id`, handed to `session` with `items` (ITEM_DTYPE)."""
        name = session.encode("ascii", "replace")
        mac = hashlib.blake2b(key=self._secret, person=PERSON, digest_size=TOKEN_BYTES)
        mac.update(struct.pack("<QH", batch_id & (2**64 - 1), len(name) & 0xFFFF))
        mac.update(name)
        mac.update(np.ascontiguousarray(items, ITEM_DTYPE).view(np.uint8))
        return mac.hexdigest()

    def verify(self, batch_id: object, session: str, token: object, items: np.ndarray) -> bool:
        """True if `token` is the token of (batch_id, session, items); False for anything else."""
        if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
            return False
        if not isinstance(token, str) or len(token) != 2 * TOKEN_BYTES:
            return False
        return hmac.compare_digest(self.token(batch_id, session, items), token)

    def covered(
        self, session: str, proofs: object, issued: np.ndarray, items: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """Which of `items` lie in a batch of `session` whose token verifies.

        `proofs` is a list of [batch_id, token, n]: batch after batch, the next
        n descriptors of `issued` are what that batch was handed out with.
        Returns (bool per item, proofs that failed). A malformed list, or one longer than
        MAX_PROOFS, proves nothing.
        """
        good: list[np.ndarray] = []
        failed = 0
        start = 0
        if not isinstance(proofs, list) or len(proofs) > MAX_PROOFS:
            return np.zeros(len(items), bool), 1 if proofs else 0
        for proof in proofs:
            if not (isinstance(proof, list) and len(proof) == 3 and isinstance(proof[2], int)):
                failed += 1
                continue
            batch_id, token, count = proof
            part = issued[start : start + max(0, count)]
            start += max(0, count)
            if len(part) == count and self.verify(batch_id, session, token, part):
                good.append(part)
            else:
                failed += 1
        if not good or not len(items):
            return np.zeros(len(items), bool), failed
        return _inside(items, good[0] if len(good) == 1 else np.concatenate(good)), failed

    def results_problem(
        self,
        session: str,
        batch_id: object,
        token: object,
        issued: np.ndarray,
        items: np.ndarray,
    ) -> str | None:
        """Why RESULTS for `items` are not for work this data dir handed to `session` in batch
        `batch_id` (whose token and descriptors, `issued`, they carry), or None."""
        inside, failed = self.covered(session, [[batch_id, token, len(issued)]], issued, items)
        if failed:
            return (
                f"the work token of batch {batch_id!r} does not verify: this data dir never "
                f"handed that batch to session {session}"
            )
        if not inside.all():
            return f"{int((~inside).sum())} result item(s) are not in batch {batch_id}"
        return None


class Refusals:
    """Refused results and claims: counted per kind, and logged at most once per kind every
    REFUSED_LOG_EVERY_S (with the count since the last line), so a flood cannot fill the log."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.counts: collections.Counter = collections.Counter()
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (when, count then)

    def add(self, kind: str, session: str, reason: str, now: float) -> None:
        """Count one refusal at monotonic `now` (the stage's step clock)."""
        self.counts[kind] += 1
        when, count = self._logged.get(kind, (float("-inf"), 0))
        if now - when >= REFUSED_LOG_EVERY_S:
            self._logged[kind] = (now, self.counts[kind])
            self.log.warning(
                "refused %s of session %s: %s (%d refused since the last such line)",
                kind,
                session,
                reason,
                self.counts[kind] - count,
            )


def _inside(items: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per item: is its exact (segment, slot, seq) in `valid`? Vectorised: equal arrays (the
    usual RESULTS) compare as bytes; otherwise a sorted search by seq, then slot and segment.
    `valid` was handed out by dispatch, so its seqs are distinct (a seq names one item)."""
    if len(items) == len(valid) and items.tobytes() == valid.tobytes():
        return np.ones(len(items), bool)
    order = np.argsort(valid["seq"], kind="stable")
    seqs = valid["seq"][order]
    at = np.searchsorted(seqs, items["seq"])
    found = at < len(valid)
    match = valid[order[np.minimum(at, len(valid) - 1)]]
    return (
        found
        & (match["seq"] == items["seq"])
        & (match["slot"] == items["slot"])
        & (match["segment"] == items["segment"])
    )


def _create(path: Path) -> None:
    """Write a new random secret at `path` unless one appeared meanwhile; durable when it returns."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never over an existing secret
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
