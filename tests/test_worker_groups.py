"""Local workers for several models: one `[[workers]]` table per model, real processes."""

from __future__ import annotations

import json

import pytest
from broker import WORDS, Broker, submit, write_config
from test_dispatch_pipeline import assert_each_once, fetch, finished, job_info, stop_and_check

from config import load_settings
from pipeline.core.errors import ConfigError

GROUPS = """[[workers]]
model = "echo"
count = 2
[[workers]]
model = "sim"
count = 1
options = {tokens_per_s = 50000.0}
"""


def lines(path, model: str, n: int) -> None:
    with open(path, "w") as out:
        for i in range(n):
            body = {"model": model}
            if model == "echo":
                body["prompt_token_ids"] = list(range(1, 2 + i % 50))
            else:
                body["input"] = " ".join(WORDS[i % 100 : i % 100 + 1 + i % 20])
            line = {"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/embeddings"}
            out.write(json.dumps({**line, "body": body}) + "\n")


def test_one_host_serves_two_models_each_with_its_own_local_workers(tmp_path):
    config = write_config(tmp_path, workers=0)
    text = config.read_text()
    assert "[workers]\nlocal = 0\n" in text
    config.write_text(text.replace("[workers]\nlocal = 0\n", GROUPS))
    b = Broker(config)
    try:
        b.start()
        groups = b.settings.worker_groups
        assert [(g.model, g.local) for g in groups] == [("echo", 2), ("sim", 1)]
        assert {"worker-0", "worker-1", "worker-2"} <= set(b.pids())
        for model, n in (("echo", 300), ("sim", 200)):
            path = tmp_path / f"{model}.jsonl"
            lines(path, model, n)
            result = submit(b.config, path, "--job-id", model)
            assert result.returncode == 0, result.stderr
        for model, n in (("echo", 300), ("sim", 200)):
            out = tmp_path / f"{model}.out.jsonl"
            result = fetch(b, model, out, "--follow", timeout_s=120)  # bounds the job's time
            assert result.returncode == 0, result.stderr
            assert finished(b, model)
            assert job_info(b, model)["failed"] == 0
            assert_each_once(out, n)
        stop_and_check(b)
    finally:
        b.close()


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ('[[workers]]\nmodel = "gpt"\n', r'workers\[0\]\.model = "gpt" names no \[\[models\]\]'),
        ("[[workers]]\ncount = 2\n", r'workers\[0\]\.model = "" is missing or empty'),
        (
            '[[workers]]\nmodel = "m"\n[[workers]]\nmodel = "m"\n',
            r'workers\[1\]\.model = "m" repeats workers\[0\]\.model',
        ),
        ('[[workers]]\nmodel = "m"\ncount = 0\n', r"workers\[0\]\.count = 0 is below 1"),
        ('[[workers]]\nmodel = "m"\nlocal = 2\n', r"unknown key workers\[0\]\.local = 2"),
        ('[workers]\nmodel = "gpt"\n', r'workers\.model = "gpt" names no \[\[models\]\]'),
        (
            '[[workers]]\nmodel = "m"\noptions = {threads = [1]}\n',
            r"workers\[0\]\.options = .* has threads = \[1\]",
        ),
    ],
)
def test_bad_worker_tables_are_refused_naming_file_key_and_value(tmp_path, groups, message):
    path = tmp_path / "w.toml"
    path.write_text(groups + '[[models]]\nname = "m"\nengine = "echo"\n')
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(path)
    assert str(caught.value).startswith(str(path))


def test_a_plain_workers_table_still_means_local_workers_of_one_model(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text('[workers]\nlocal = 3\nmodel = "m"\n[[models]]\nname = "m"\nengine = "echo"\n')
    settings = load_settings(path)
    assert [(g.model, g.local) for g in settings.worker_groups] == [("m", 3)]
    assert settings.workers.local == 3
    path.write_text('[workers]\nlocal = 0\n[[models]]\nname = "m"\nengine = "echo"\n')
    assert load_settings(path).worker_groups == ()
