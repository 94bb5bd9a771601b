"""128-bit digests of byte strings, vectorised: many ids hashed in a few numpy passes.

The front hashes every custom_id of every chunk (ingest/custom_ids.py); one
`hashlib.blake2b` call per id in a Python generator cost about a microsecond
an id, a third of the front's time. Here the ids of a batch, given as one
UTF-8 blob and its offsets (as they arrive on the wire), are read as
little-endian 64-bit words straight from the blob (an unaligned strided
view, the bytes past an id's end masked off); ids are taken longest first,
so word j of every id that has one is one gather, and each word is folded
into two independent 64-bit lanes:

    h = (h ^ word) * P;  h ^= h >> 32        (per word, per lane)
    digest = fmix64 of each lane, seeded with the id's length, then cross-mixed

Both steps are bijections of h for a given word and of the word for a
given h, so two ids of the same length that differ in one 8-byte word never
share a digest; otherwise two different ids share one with probability
about 2**-128, so among n ids some pair does with probability about
n**2 / 2**129 (about 1e-21 for a billion ids), as with BLAKE2b. The length
is hashed in, so "a" and "a\\0" differ.

This is not a cryptographic hash: a producer who crafts two colliding
custom_ids gets the second reported as a duplicate of the first, in its own
job, which is all a collision can do here. Digests live only in memory (the
job journal keeps the ids themselves), so the function may change between
versions; it is deterministic, so digests agree between processes.

| function              | input                                  | output            |
|-----------------------|----------------------------------------|-------------------|
| `blob_digests`        | uint8 blob, int64 offsets (n + 1)      | (hi, lo) uint64 n |
| `str_digests`         | a sequence of str                      | (hi, lo) uint64 n |
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_P1 = np.uint64(0x9E3779B97F4A7C15)  # odd multipliers: the golden ratio, and two of xxh64's
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_SEED1 = np.uint64(0x243F6A8885A308D3)  # digits of pi: nothing up the sleeve
_SEED2 = np.uint64(0x13198A2E03707344)
_FMIX1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's finaliser
_FMIX2 = np.uint64(0xC4CEB9FE1A85EC53)
# _MASKS[k]: the low k bytes of a word (the bytes of an id in its last, partial word)
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def blob_digests(blob: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (hi, lo) digests of the ids blob[offsets[i]:offsets[i + 1]]."""
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    if n <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    lengths = np.diff(offsets)
    words = (lengths + 7) >> 3
    uniform = bool((words == words[0]).all())
    order = None if uniform else np.argsort(-words, kind="stable")  # longest first
    starts = offsets[:-1] if order is None else offsets[:-1][order]
    lengths = lengths if order is None else lengths[order]
    # active[j]: how many ids (a prefix, longest first) have a word j
    active = n - np.cumsum(np.bincount(words, minlength=int(words.max()) + 1))
    h1, h2 = _fold(np.asarray(blob, dtype=np.uint8).reshape(-1), starts, lengths, active)
    if order is None:
        return h1, h2
    hi, lo = np.empty_like(h1), np.empty_like(h2)
    hi[order], lo[order] = h1, h2
    return hi, lo


def str_digests(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The digests of `ids`' UTF-8 bytes (lone surrogates kept, as surrogatepass writes them)."""
    n = len(ids)
    joined = "".join(ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    if joined.isascii():  # one byte a character: no per-id encoding
        np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=n), out=offsets[1:])
        blob = joined.encode("ascii")
    else:
        encoded = [cid.encode("utf-8", "surrogatepass") for cid in ids]
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=n), out=offsets[1:])
        blob = b"".join(encoded)
    return blob_digests(np.frombuffer(blob, dtype=np.uint8), offsets)


def _fold(
    blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray, active: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Hash ids sorted longest first: one pass per 8-byte column over the ids that reach it."""
    padded = np.zeros(len(blob) + 8, dtype=np.uint8)
    padded[: len(blob)] = blob
    # word_at[p]: the 8 bytes from p, little-endian (an unaligned strided view, no copy)
    word_at = np.ndarray((len(blob) + 1,), dtype="<u8", buffer=padded, strides=(1,))
    length = lengths.astype(np.uint64)
    h1 = _SEED1 ^ (length * _P3)
    h2 = _SEED2 ^ (length * _P1)
    for j, m in enumerate(active[:-1].tolist()):
        if m == 0:
            break
        word = word_at[starts[:m] + 8 * j] & _MASKS[np.minimum(lengths[:m] - 8 * j, 8)]
        a = (h1[:m] ^ word) * _P1
        h1[:m] = a ^ (a >> np.uint64(32))
        b = (h2[:m] ^ ((word << np.uint64(31)) | (word >> np.uint64(33)))) * _P2
        h2[:m] = b ^ (b >> np.uint64(29))
    h1, h2 = _fmix(h1), _fmix(h2 ^ _SEED1)
    h1 += h2
    h2 += h1
    return h1, h2


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h *= _FMIX1
    h ^= h >> np.uint64(33)
    h *= _FMIX2
    h ^= h >> np.uint64(33)
    return h
