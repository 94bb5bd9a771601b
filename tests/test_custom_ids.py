"""The vectorised custom_id digests (ingest/id_digest.py) and the digest set's bucket index."""

from __future__ import annotations

import numpy as np
import pytest

from ingest import custom_ids
from ingest.chunk_check import chunk_digests
from ingest.chunk_wire import _strings, chunk_to_wire
from ingest.custom_ids import CustomIdSet
from ingest.id_digest import blob_digests, str_digests
from ingest.input_chunk import InputChunk
from ingest.request_shape import Shape

ODD = [
    "",
    "a",
    "a\x00",
    "\x00",
    "é",
    "\U0001f600",
    "x" * 7,
    "x" * 8,
    "x" * 9,
    "x" * 512,
    "日本" * 40,
]


def pairs(digests: tuple[np.ndarray, np.ndarray]) -> list[tuple[int, int]]:
    return list(zip(digests[0].tolist(), digests[1].tolist(), strict=True))


def test_an_ids_digest_does_not_depend_on_the_other_ids_of_its_batch():
    together = pairs(str_digests(ODD))
    alone = [pairs(str_digests([cid]))[0] for cid in ODD]
    backwards = pairs(str_digests(ODD[::-1]))[::-1]
    assert together == alone == backwards
    assert len(set(together)) == len(ODD)  # "a" and "a\0" differ: the length is hashed in


def test_blob_digests_equal_str_digests_of_the_decoded_ids():
    encoded = [cid.encode() for cid in ODD]
    offsets = np.zeros(len(ODD) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), np.uint8)
    assert pairs(blob_digests(blob, offsets)) == pairs(str_digests(ODD))
    assert pairs(str_digests([])) == [] and pairs(blob_digests(blob[:0], offsets[:1])) == []


def test_the_front_hashes_the_wire_blob_as_the_journal_replay_hashes_the_strs():
    n = len(ODD)
    chunk = InputChunk(
        index=0,
        first_line=1,
        last_line=n,
        line=np.arange(1, n + 1, dtype=np.uint64),
        custom_ids=tuple(ODD),
        models=("m",),
        model_index=np.zeros(n, np.int64),
        shapes=(Shape("/v1/embeddings", None, None, None, None, (), 0),),
        shape_index=np.zeros(n, np.int64),
        tokens=np.ones(n, np.uint32),
        offsets=np.arange(n + 1, dtype=np.int64),
        text_items=np.zeros(0, np.int64),
        texts=(),
        errors=(),
    )
    _, arrays = chunk_to_wire(chunk)
    assert pairs(chunk_digests(arrays)) == pairs(str_digests(ODD))


def test_the_wire_decodes_every_id_whole_with_or_without_a_nul_among_them():
    for ids in ([], [""], ["", "a", ""], ["é", "日本", "x"], ["x\x00y", "", "z"]):
        encoded = [cid.encode() for cid in ids]
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        assert _strings(b"".join(encoded), offsets) == tuple(ids)
    with pytest.raises(UnicodeDecodeError):  # an offset inside a character: bad UTF-8
        _strings("é".encode(), np.array([0, 1, 2]))


def test_no_two_of_a_million_sequential_ids_share_a_digest_or_its_high_half():
    hi, _ = str_digests([f"item-{i}" for i in range(1_000_000)])
    assert len(np.unique(hi)) == 1_000_000


def test_a_large_set_answers_like_a_python_set_across_many_buckets():
    rng = np.random.default_rng(11)
    seen, reference = CustomIdSet(), set()
    for _ in range(40):
        ids = [f"u-{v}" for v in rng.integers(0, 200_000, 4096)]
        expected = []
        for cid in ids:
            expected.append(cid in reference)
            reference.add(cid)
        probe = [f"u-{v}" for v in rng.integers(0, 200_000, 512)]
        assert seen.add(ids).tolist() == expected
        assert seen.contains(probe).tolist() == [cid in reference for cid in probe]
    assert len(seen) == len(reference)


def test_add_new_records_without_a_lookup_and_later_lookups_find_them():
    seen = CustomIdSet()
    seen.add(["a", "b"])
    seen.add_new(str_digests(["c", "d"]))
    assert len(seen) == 4
    assert seen.contains(["a", "c", "d", "e"]).tolist() == [True, True, True, False]


def test_a_lookup_of_new_ids_searches_the_runs_only_for_the_prefilter_s_few_hits(monkeypatch):
    """A job's ids are about always new: of 4,096 new ids looked up in a set of 100,000, the
    prefilter turns away all but 1 in 8 to 16 before any run is searched (a search of every
    run for every id cost the front about 0.5 us per id in a job of a million)."""
    rng = np.random.default_rng(5)

    def fresh(n: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False) for _ in "hl")

    seen = CustomIdSet()
    for _ in range(25):
        seen.add_new(fresh(4096))
    searched = []
    members = custom_ids._Run.members
    monkeypatch.setattr(
        custom_ids._Run,
        "members",
        lambda run, hi, lo: searched.append(hi.size) or members(run, hi, lo),
    )
    probe = fresh(4096)
    assert not seen.contains((), digests=probe).any()
    assert max(searched, default=0) < 4096 // 4, f"ids searched per run: {searched}"
    known = (probe[0][:100], probe[1][:100])
    seen.add_new(known)
    assert seen.contains((), digests=probe)[:100].all(), "a filter never turns away an id it holds"
