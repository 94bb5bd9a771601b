"""Record logs, the durable counter and the shape table, on real files and processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.store.counter import DurableCounter
from pipeline.store.intern_table import InternTable
from pipeline.store.records import RecordLog, encode_record, read_records

EMBED = {"endpoint": "/v1/embeddings", "priority": 0}
CHAT = {"endpoint": "/v1/chat/completions", "max_tokens": 16, "temperature": 0.0, "priority": 2}


def test_records_survive_reopen_and_a_torn_tail_is_cut(tmp_path):
    path = tmp_path / "log"
    log = RecordLog(path)
    log.append({"a": 1})
    log.append({"b": [1, 2]})
    assert log.records == []  # not durable yet
    log.sync()
    log.close()
    with open(path, "ab") as f:
        f.write(encode_record({"c": 3})[:-2])  # a crash mid-write
    assert read_records(path)[0] == [{"a": 1}, {"b": [1, 2]}]
    again = RecordLog(path)
    again.append({"d": 4})
    again.sync()
    again.close()
    assert read_records(path)[0] == [{"a": 1}, {"b": [1, 2]}, {"d": 4}]


def test_a_flipped_byte_stops_the_reader_there(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(encode_record({"a": 1}) + encode_record({"b": 2}) + encode_record({"c": 3}))
    data = bytearray(path.read_bytes())
    data[len(encode_record({"a": 1})) + 10] ^= 1
    path.write_bytes(bytes(data))
    assert read_records(path)[0] == [{"a": 1}]


def test_counter_is_unique_across_processes_and_honours_the_floor(tmp_path):
    code = (
        "import sys; from pipeline.store.counter import DurableCounter;"
        "c = DurableCounter(sys.argv[1]); print(' '.join(str(c.next()) for _ in range(100)))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "n")], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    got = [int(x) for p in procs for x in p.communicate(timeout=60)[0].split()]
    assert sorted(got) == list(range(1, 301))
    assert DurableCounter(tmp_path / "n").next(floor=1000) == 1000
    assert DurableCounter(tmp_path / "n").next() == 1001


def test_a_reserved_block_is_never_handed_out_again_even_below_the_floor(tmp_path):
    """Dispatch reserves batch ids in blocks with the wall clock as the floor; a clock
    stepped back (a lower floor) still gets ids past every block reserved before."""
    counter = DurableCounter(tmp_path / "next-batch-id")
    first = counter.next(floor=5_000_000, count=1 << 20)
    assert first == 5_000_000
    again = DurableCounter(tmp_path / "next-batch-id").next(floor=1_000, count=1 << 20)
    assert again == first + (1 << 20)


def test_shape_ids_are_shared_durable_and_canonical(tmp_path):
    table = InternTable(tmp_path)
    embed = table.id_for(EMBED)
    chat = table.id_for(CHAT)
    assert (embed, chat) == (1, 2)
    assert table.id_for(dict(reversed(list(CHAT.items())))) == chat  # key order does not matter
    other = InternTable(tmp_path)  # another process's view
    assert other.value(chat) == CHAT and other.id_for(CHAT) == chat
    third = {**CHAT, "priority": 3}
    assert other.id_for(third) == 3
    assert table.value(3) == third  # found on re-read
    with pytest.raises(Exception, match="id 9 is not in"):
        table.value(9)


def test_shapes_added_by_racing_processes_get_one_id_each(tmp_path):
    code = (
        "import sys; from pipeline.store.intern_table import InternTable; t = InternTable(sys.argv[1]);"
        "print(' '.join(str(t.id_for({'endpoint': 'e', 'priority': p})) for p in range(20)))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert outs[0] == outs[1] == outs[2]
    assert sorted(map(int, outs[0])) == list(range(1, 21))


def test_a_job_is_queued_only_when_every_chunk_up_to_the_final_one_is_committed(tmp_path):
    from ingest.jobs import JobRegistry

    registry = JobRegistry(tmp_path)
    job = registry.create("j-1", chunk_lines=2)
    for chunk in (0, 1, 2):
        job.accept(chunk, chunk * 2 + 1, chunk * 2 + 2)
    job.commit(2, [5], ["c"], 1, [], final=True)  # the last chunk lands first
    assert job.state == "validating"
    job.commit(0, [1, 2], ["a", "b"], 2, [], final=False)
    assert job.state == "validating"
    job.commit(1, [3], ["d"], 1, [[4, "e", "invalid_json", "line 4: bad"]], final=False)
    assert job.state == "queued"
    registry.touch(job)
    registry.flush()
    registry.close()
    again = JobRegistry(tmp_path).get("j-1")  # rebuilt from the journal alone
    assert (again.state, again.stored, again.rejected, again.chunk_lines) == ("queued", 4, 1, 2)
    assert again.custom_ids.contains(["a", "e", "zz"]).tolist() == [True, False, False]
    with pytest.raises(Exception, match="job id 'bad id' is not allowed"):
        JobRegistry(tmp_path).get("bad id")


def test_a_commit_is_pending_until_its_journal_is_synced(tmp_path):
    from ingest.jobs import JobRegistry

    registry = JobRegistry(tmp_path)
    job = registry.create("j-2", chunk_lines=10)
    job.accept(0, 1, 10)
    job.commit(0, [1], ["a"], 1, [], final=True)
    assert job.commit_pending(0) and not job.commit_pending(1)
    registry.touch(job)
    registry.flush()
    assert not job.commit_pending(0)
    registry.close()
