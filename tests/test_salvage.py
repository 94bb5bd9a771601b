"""Isolating a damaged input segment: only what a second source confirms is trusted."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
from conftest import KEY, SLOT_BYTES

from pipeline.store.datadir import DataDir
from pipeline.store.recovery import recover
from pipeline.store.salvage import isolate, isolated_files
from pipeline.store.segment import Segment
from pipeline.store.segment_format import DEAD, HEADER_CHECKED, KIND_INPUT, SegmentKey

JOB_NO = 3


@pytest.fixture
def damaged_input(data_dir, rng):
    """One sealed input segment of 40 items of job 3 (slot 6 retired); returns its path."""
    seg = Segment.create(data_dir.segments, 1, KEY, SLOT_BYTES, 40)
    index = np.arange(40, dtype=np.uint32)
    seq = (np.uint64(JOB_NO) << np.uint64(32)) | index.astype(np.uint64)
    counts = rng.integers(1, 64, 40).astype(np.uint32)
    tokens = rng.integers(1, 30_000, (40, 64)).astype(np.uint32)
    seg.append(seq, np.full(40, JOB_NO, np.uint64), index, counts, tokens)
    seg.markers[6] = DEAD
    seg.seal()
    seg.sync()
    seg.close()
    return seg.path


def isolated_seqs(data_dir, path) -> list[int]:
    (damaged,) = recover(data_dir).damaged
    moved = isolate(data_dir, damaged)
    assert moved is not None and isolated_files(data_dir) == [data_dir.damaged / path.name]
    assert not path.exists()
    if moved.into is None:
        return []
    with Segment.open(moved.into) as seg:
        assert seg.sealed and (seg.states() == 1).all()
        assert seg.verify(np.arange(seg.capacity)).all()
        return (seg.slots["seq"] & np.uint64(0xFFFFFFFF)).tolist()


def test_a_truncated_segment_gives_up_only_the_slots_past_the_cut(data_dir, damaged_input):
    with Segment.open(damaged_input) as seg:
        cut = seg.header.slots_offset + 25 * seg.header.slot_bytes + 100  # inside slot 25
    os.truncate(damaged_input, cut)
    assert isolated_seqs(data_dir, damaged_input) == [i for i in range(25) if i != 6]


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def test_a_header_that_fails_its_checksum_is_trusted_where_name_and_size_agree(
    data_dir, damaged_input
):
    flip(damaged_input, 44)  # created_ns: nothing else says what it was, nothing needs it
    assert isolated_seqs(data_dir, damaged_input) == [i for i in range(40) if i != 6]


def test_a_flipped_byte_of_the_model_name_field_leaves_every_item_served(tmp_path, damaged_input):
    """Issue 30 point 6: the name field (bytes 48..111: the letters of "minilm", then its NUL
    padding) was believed only if it still spelt the file name's model, so one flipped byte
    of it made every item a corrupt_input error; the file name spells the model whole."""
    pristine = damaged_input.read_bytes()
    assert KEY.name == "minilm" and pristine[48:54] == b"minilm"
    for offset in range(48, 112):
        data_dir = DataDir(tmp_path / f"flipped-{offset}").ensure()
        path = data_dir.segments / damaged_input.name
        path.write_bytes(pristine)
        flip(path, offset)
        assert isolated_seqs(data_dir, path) == [i for i in range(40) if i != 6], offset
        (into,) = data_dir.segments.glob("in-*.seg")
        with Segment.open(into) as seg:
            assert seg.header.key == KEY, offset


@pytest.mark.parametrize("offset", [24, 32])  # shape, slot_bytes
def test_a_damaged_header_field_that_disagrees_trusts_nothing(data_dir, damaged_input, offset):
    flip(damaged_input, offset)
    assert isolated_seqs(data_dir, damaged_input) == []


def test_a_newer_version_is_whole_and_left_alone(data_dir, damaged_input):
    with open(damaged_input, "r+b") as f:
        head = bytearray(f.read(HEADER_CHECKED))
        struct.pack_into("<I", head, 8, 2)
        f.seek(0)
        f.write(head + struct.pack("<I", zlib.crc32(head)))
    (damaged,) = recover(data_dir).damaged
    assert isolate(data_dir, damaged) is None and damaged_input.exists()


def test_a_model_name_with_a_slash_is_read_back_from_its_file_name(data_dir, rng):
    """A model named like a Hugging Face id is `%2F`-encoded in its file name: salvage of a
    header whose name field is damaged decodes the file name back to the model's name."""
    key = SegmentKey(KIND_INPUT, "meta-llama/Llama-3.1-8B-Instruct", KEY.shape, KEY.lane)
    seg = Segment.create(data_dir.segments, 1, key, SLOT_BYTES, 8)
    index = np.arange(8, dtype=np.uint32)
    seq = (np.uint64(JOB_NO) << np.uint64(32)) | index.astype(np.uint64)
    counts = np.full(8, 4, np.uint32)
    seg.append(
        seq,
        np.full(8, JOB_NO, np.uint64),
        index,
        counts,
        rng.integers(1, 99, (8, 64)).astype(np.uint32),
    )
    seg.seal()
    seg.sync()
    seg.close()
    assert "%2F" in seg.path.name
    flip(seg.path, 50)  # a letter of the name field
    assert isolated_seqs(data_dir, seg.path) == list(range(8))
    (into,) = data_dir.segments.glob("in-*.seg")
    with Segment.open(into) as salvaged:
        assert salvaged.header.key == key
