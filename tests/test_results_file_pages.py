"""`ResultFile.write_page`: a page of lines in one buffer, each key still written at most once.

A page whose keys are all new goes to the file in one piece; a page sent
again (the client or completion restarted between its write and its ack), or
one that overlaps what the file holds, is written line by line and only its
new keys land; a key twice in one page lands once. A sync with nothing
written since the last one does not touch the disk.
"""

from __future__ import annotations

import os

import pytest

from collector.delivery.result_file import ResultFile


def page(*names: str) -> tuple[bytes, list[str]]:
    data = b"".join(b'{"id":"%s","custom_id":"%s"}\n' % (n.encode(), n.encode()) for n in names)
    return data, [f"custom_id:{n}" for n in names]


def test_a_new_page_goes_in_whole_and_a_page_sent_again_adds_nothing(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultFile.open(path) as out:
        assert out.write_page(*page("a", "b", "c")) == 3
        assert out.write_page(*page("a", "b", "c")) == 0  # the same page again
        assert out.write_page(*page("c", "d", "b", "e")) == 2  # overlapping: d and e only
        assert out.write_page(*page("f", "f", "g")) == 2  # a key twice in one page: once
        assert out.write_page(b"", []) == 0
        out.sync()
    assert path.read_bytes() == page("a", "b", "c", "d", "e", "f", "g")[0]
    with ResultFile.open(path) as again:  # keys come back from the file
        assert again.write_page(*page("g", "h")) == 1
        again.sync()
    assert path.read_bytes() == page("a", "b", "c", "d", "e", "f", "g", "h")[0]


def test_a_page_of_partial_lines_is_refused_and_leaves_its_keys_out(tmp_path):
    with ResultFile.open(tmp_path / "out.jsonl") as out:
        data, keys = page("a", "b")
        with pytest.raises(ValueError, match="partial lines"):
            out.write_page(data[:-1], keys)
        assert "custom_id:a" not in out and len(out) == 0
        with pytest.raises(ValueError, match="lines but 1 keys"):
            out.write_page(*page("x", "y")[:1], ["custom_id:x"])  # one key short
        assert len(out) == 0
        assert out.write_page(data, keys) == 2


def test_a_sync_with_nothing_new_does_not_reach_the_disk(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    with ResultFile.open(tmp_path / "err.jsonl") as err:
        synced.clear()  # open syncs a cut file or a new one's directory
        err.sync()  # the first sync always goes to the disk
        err.sync()
        err.write_page(b"", [])
        err.sync()
        assert len(synced) == 1
        err.write_page(*page("a"))
        err.sync()
        assert len(synced) == 2


def test_a_page_appended_while_a_sync_runs_on_another_thread_waits_for_the_next(
    tmp_path, monkeypatch
):
    """The results client fsyncs a page on a thread while it appends the next: a flag cleared
    when the fsync returned took that next page for synced, and its sync never ran."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(fd)
        if len(synced) == 1:  # the next page lands while this fsync runs
            out.write_page(*page("b"))
        real(fd)

    with ResultFile.open(tmp_path / "out.jsonl") as out:
        out.write_page(*page("a"))
        monkeypatch.setattr(os, "fsync", fsync)
        out.sync()
        out.sync()  # "b" came after the first fsync began: this one must reach the disk
        assert len(synced) == 2


def test_a_page_given_by_its_custom_ids_is_deduplicated_with_every_other_key(tmp_path):
    """`write_custom_ids` (the client's templated pages: no `custom_id:` string per line) and
    `write_page` share one set of keys, read back at open, and a custom_id never meets the
    id of a line that has none (`{"id": "x", "custom_id": null}` is not custom_id x)."""
    path = tmp_path / "out.jsonl"
    null_x = b'{"id":"x","custom_id":null}\n'
    with ResultFile.open(path) as out:
        assert out.write_page(null_x, ["id:x"]) == 1
        assert out.write_page(*page("a")) == 1
        data, _ = page("a", "x", "b")
        assert out.write_custom_ids(data, ["a", "x", "b"]) == 2  # a was there: line by line
        data, _ = page("c", "c")
        assert out.write_custom_ids(data, ["c", "c"]) == 1  # twice in one page: once
        assert "custom_id:x" in out and "id:x" in out and "custom_id:c" in out
        assert out.write_page(*page("b", "d")) == 1
        out.sync()
    assert path.read_bytes() == null_x + page("a", "x", "b", "c", "d")[0]
    with ResultFile.open(path) as again:  # the same keys, from the file
        data, _ = page("x", "e")
        assert again.write_custom_ids(data, ["x", "e"]) == 1
        assert again.write_page(b'{"id":"x","custom_id":null}\n', ["id:x"]) == 0
        assert len(again) == 7


def test_sectors_of_zeros_from_a_torn_write_back_are_cut_with_everything_after_them(tmp_path):
    """The power went before a page was synced, and the disk kept some of its sectors and
    not others: zeros stand where the lost ones were. Those lines were never acknowledged
    (they come again); the file is cut before the first of them, not refused as foreign."""
    path = tmp_path / "out.jsonl"
    synced, _ = page("a", "b")
    later, _ = page("c", "d", "e")
    path.write_bytes(synced + b"\0" * 7 + later[7:])  # c's first sector lost, d and e kept
    with ResultFile.open(path) as again:
        assert again.cut_bytes == len(later)
        assert again.write_page(*page("c", "d", "e")) == 3
        again.sync()
    assert path.read_bytes() == synced + later
