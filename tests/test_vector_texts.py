"""`vectors search` shows each hit's text, read back from its job's input file (real broker)."""

from __future__ import annotations

import json

from broker import Broker, submit, write_config
from conftest import wait_for
from test_vector_delivery import NEEDLE, SIM_WORKER, cli, delivered, write_texts

from collector.vectors.texts import line_text
from pipeline.core import exitcodes


def test_search_defaults_to_the_models_store_and_prints_the_hits_text(tmp_path):
    b = Broker(write_config(tmp_path, workers=1, worker_keys=SIM_WORKER)).start()
    try:
        path = tmp_path / "in.jsonl"
        write_texts(path, 300)
        done = submit(b.config, path, "--job-id", "emb", "--deliver", "vectors")  # store `sim`
        assert done.returncode == 0, done.stderr
        wait_for(lambda: delivered(b, "emb"), "the job to reach the store", timeout_s=90)
        hits = cli(b.config, "vectors", "search", "--text", NEEDLE, "-k", "2", "--json")
        assert hits.returncode == 0, hits.stderr
        top = [json.loads(line) for line in hits.stdout.splitlines()]
        assert (top[0]["custom_id"], top[0]["text"]) == ("t3", NEEDLE)
        assert top[1]["text"] and top[1]["text"] != NEEDLE
        table = cli(b.config, "vectors", "search", "--text", NEEDLE, "-k", "1")
        assert table.returncode == 0 and NEEDLE in table.stdout.splitlines()[2]
        # The input file changed since: a line whose custom_id differs is not the hit's text.
        path.write_text(path.read_text().replace('"t3"', '"other"'))
        hits = cli(b.config, "vectors", "search", "--text", NEEDLE, "-k", "1", "--json")
        assert json.loads(hits.stdout)["custom_id"] == "t3"
        assert json.loads(hits.stdout)["text"] is None
        path.unlink()  # gone: the custom_id alone, no error
        hits = cli(b.config, "vectors", "search", "--text", NEEDLE, "-k", "1", "--json")
        assert hits.returncode == 0 and json.loads(hits.stdout)["text"] is None
        assert b.stop() == exitcodes.OK
    finally:
        b.close()


def test_line_text_takes_input_prompt_or_the_last_message():
    assert line_text({"body": {"input": "a b"}}) == "a b"
    assert line_text({"body": {"input": ["a", "b"]}}) == "a"  # each input its own vector
    assert line_text({"body": {"input": ["a", "b"]}}, part=1) == "b"
    assert line_text({"body": {"input": ["a", "b"]}}, part=2) is None
    assert line_text({"body": {"prompt": "p"}}) == "p"
    assert line_text({"body": {"messages": [{"content": "x"}, {"content": "y"}]}}) == "y"
    assert line_text({"body": {"prompt_token_ids": [1, 2]}}) is None
    assert line_text(["not", "a", "line"]) is None
