"""Configuration: defaults, shipped files, every refusal, immutability, helpers."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from config import ConfigError, Settings, load_settings
from config.defaults import DEFAULTS, MODEL_DEFAULTS, SECTIONS
from config.rules import MODEL_RULES, RULES

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [ROOT / "config" / "default.toml", ROOT / "config" / "prod.example.toml"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fabric.toml"
    path.write_text(text)
    return path


def test_defaults_load_with_every_value_from_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = load_settings(None)
    for section in SECTIONS:
        for key, default in DEFAULTS[section].items():
            value = getattr(getattr(settings, section), key)
            if isinstance(default, dict):  # a table: sorted (key, value) pairs, hashable
                default = sorted(default.items())
            assert value == (tuple(default) if isinstance(default, list) else default)
            assert type(value) is (tuple if isinstance(default, list) else type(default))
    assert [m.name for m in settings.models] == ["minilm"]
    assert settings.model("minilm").endpoints == ("/v1/embeddings",)
    assert settings.data_path == tmp_path.resolve() / "var" / "fabric"
    assert settings.source == "<defaults>"


def test_every_key_has_a_field_and_a_rule():
    settings = load_settings(None)
    for section in SECTIONS:
        fields = [f.name for f in dataclasses.fields(getattr(settings, section))]
        assert fields == list(DEFAULTS[section])
    assert set(RULES) == {f"{s}.{k}" for s in SECTIONS for k in DEFAULTS[s]}
    assert list(MODEL_RULES) == list(MODEL_DEFAULTS)
    assert [f.name for f in dataclasses.fields(settings.models[0])] == list(MODEL_DEFAULTS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_files_load(path):
    assert isinstance(load_settings(path), Settings)


def test_prod_example_sets_every_key_with_a_comment():
    path = ROOT / "config" / "prod.example.toml"
    data = tomllib.loads(path.read_text())
    for section in SECTIONS:
        assert list(data[section]) == list(DEFAULTS[section]), section
    for model in data["models"]:
        assert list(model) == list(MODEL_DEFAULTS)
    lines = path.read_text().splitlines()
    for before, line in zip(["", *lines], lines, strict=False):
        if re.match(r"\s*[a-z_]+\s*=", line):
            assert "#" in line or before.lstrip().startswith("#"), line


def test_docs_table_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    keys = [(s, k) for s in SECTIONS for k in DEFAULTS[s]] + [("models", k) for k in MODEL_DEFAULTS]
    missing = [f"{s}.{k}" for s, k in keys if f"| {s} | `{k}` |" not in text]
    assert missing == []


def test_int_is_accepted_where_a_float_is_allowed(tmp_path):
    settings = load_settings(write(tmp_path, "[dispatch]\nlease_s = 5\n"))
    assert settings.dispatch.lease_s == 5.0
    assert isinstance(settings.dispatch.lease_s, float)


def test_endpoints_default_follows_the_engine(tmp_path):
    text = '[[models]]\nname = "gen"\nengine = "vllm"\n'
    model = load_settings(write(tmp_path, text)).model("gen")
    assert model.endpoints == ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    assert (model.tokenizer, model.max_tokens) == ("", 32768)


MODEL = '[[models]]\nname = "m"\nengine = "echo"\n'


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[broker]\nlanes 64\n", ["line 2", "lanes 64", "invalid TOML"]),
        ("[brokr]\nlanes = [1]\n", ["[brokr]", "did you mean [broker]"]),
        ('data_dir = "x"\n', ['data_dir = "x"', "did you mean broker.data_dir"]),
        ("[broker]\nsegment_byte = 5\n", ["broker.segment_byte = 5", "broker.segment_bytes?"]),
        ("[ingest]\nlease_s = 3\n", ["ingest.lease_s = 3", "did you mean dispatch.lease_s"]),
        ("[ingest]\nprocesses = true\n", ["ingest.processes = true", "a boolean", "integer"]),
        ("[ingest]\nprocesses = 2.0\n", ["ingest.processes = 2.0", "a float", "integer"]),
        ('[dispatch]\nlease_s = "5m"\n', ['dispatch.lease_s = "5m"', "a string", "number"]),
        ("[router]\nprocesses = 0\n", ["router.processes = 0", "below 1"]),
        ("[dispatch]\nlease_s = -1.0\n", ["dispatch.lease_s = -1.0", "negative", "> 0"]),
        ("[collector]\ninterval_s = 0\n", ["collector.interval_s = 0", "zero"]),
        ("[dispatch]\nsession_timeout_s = nan\n", ["dispatch.session_timeout_s = nan", "finite"]),
        ("[broker]\nsegment_bytes = 1024\n", ["broker.segment_bytes = 1024", "1048576"]),
        (
            "[broker]\nlanes = [64, 256, 128]\n",
            ["broker.lanes = [64, 256, 128]", "256 is followed"],
        ),
        ("[broker]\nlanes = [0, 64]\n", ["broker.lanes = [0, 64]", "above 0"]),
        ("[broker]\nlanes = [64, 2097152]\n", ["broker.lanes = [64, 2097152]", "1048576"]),
        ("[broker]\nlanes = []\n", ["broker.lanes = []", "empty"]),
        ("[api]\nmax_header_bytes = 100\n", ["api.max_header_bytes = 100", ">= 4096"]),
        ("[api]\nmax_connections = 0\n", ["api.max_connections = 0", "below 1"]),
        ("[api]\nrequest_head_timeout_s = 0\n", ["api.request_head_timeout_s = 0", "zero"]),
        ("[api]\nkeep_alive_timeout_s = -1\n", ["api.keep_alive_timeout_s = -1", "negative"]),
        ('[ingest]\nbind = "127.0.0.1:7710"\n', ['ingest.bind = "127.0.0.1:7710"', "tcp://"]),
        ('[ingest]\nbind = "tcp://127.0.0.1:0"\n', ["ingest.bind", "port 0"]),
        ('[ingest]\nbind = "tcp://127.0.0.1:123456"\n', ["ingest.bind", "port 123456", "1-65535"]),
        ('[ingest]\nbind = "tcp://::1:7710"\n', ["ingest.bind", "tcp://host:port"]),
        (f'[ingest]\nbind = "ipc:///{"x" * 120}"\n', ["ingest.bind", "107 bytes"]),
        ('[dispatch]\nbind = "tcp://*:7710"\n', ["dispatch.bind", "clashes with ingest.bind"]),
        ("[models]\nname = 'm'\n", ["models = { name", "[[models]]"]),
        ("models = []\n", ["models = []", "is empty"]),
        ('[[models]]\nname = "m"\n', ["models[0] has no engine", "vllm"]),
        ('[[models]]\nname = "m"\nengine = "gpt"\n', ['models[0].engine = "gpt"', "vllm"]),
        ('[[models]]\nname = "a b"\nengine = "echo"\n', ['models[0].name = "a b"', "letters"]),
        (MODEL + "engines = 1\n", ["models[0].engines = 1", "did you mean models[0].engine"]),
        (MODEL + MODEL, ['models[1].name = "m"', "repeats models[0].name"]),
        (MODEL + "max_tokens = 0\n", ["models[0].max_tokens = 0", "below 1"]),
        (MODEL + 'endpoints = ["/v1/x"]\n', ['models[0].endpoints = ["/v1/x"]', "/v1/embeddings"]),
        (
            "[broker]\nlanes = [64, 128]\n",
            ["models[0].max_tokens = 32768 (the default)", "largest lane", "(128)"],
        ),
    ],
)
def test_refusals_name_file_key_and_value(tmp_path, text, fragments):
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    message = str(caught.value)
    assert message.startswith(str(tmp_path / "fabric.toml") + ": ")
    for fragment in fragments:
        assert fragment in message


def test_missing_file_names_the_path_and_the_example(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: no such configuration file") as caught:
        load_settings(tmp_path / "nope.toml")
    assert "config/default.toml is an example" in str(caught.value)


def test_settings_are_frozen_all_the_way_down():
    settings = load_settings(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.broker.lanes = (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.models[0].max_tokens = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.workers = None
    assert hash(settings) == hash(load_settings(None))


@pytest.mark.parametrize(
    ("n_tokens", "lane"),
    [(0, 64), (1, 64), (64, 64), (65, 128), (32767, 32768), (32768, 32768), (32769, None)],
)
def test_lane_for_picks_the_smallest_lane_that_holds(n_tokens, lane):
    assert load_settings(None).broker.lane_for(n_tokens) == lane


def test_lane_for_refuses_a_negative_count():
    with pytest.raises(ValueError, match="-1"):
        load_settings(None).broker.lane_for(-1)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown model 'gpt'; known models: minilm"):
        load_settings(None).model("gpt")


def test_overrides_apply_over_the_file_key_by_key(tmp_path, monkeypatch):
    path = write(tmp_path, "[broker]\nsegment_idle_s = 7.0\n" + MODEL)
    monkeypatch.chdir(tmp_path)
    overrides = {"broker": {"data_dir": tmp_path / "data", "lanes": (8, 16)}}
    settings = load_settings(
        path, {**overrides, "models": [{"name": "x", "engine": "echo", "max_tokens": 16}]}
    )
    assert settings.broker.segment_idle_s == 7.0
    assert settings.broker.lanes == (8, 16)
    assert settings.data_path == (tmp_path / "data").resolve()
    assert [m.name for m in settings.models] == ["x"]


def test_a_bad_override_is_blamed_on_the_overrides():
    with pytest.raises(ConfigError, match=r"^overrides: writers\.flush_ms = -2\.0 is negative"):
        load_settings(None, {"writers": {"flush_ms": -2.0}})


def test_data_path_is_fixed_at_load_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = load_settings(None, {"broker": {"data_dir": "rel"}})
    monkeypatch.chdir(ROOT)
    assert settings.data_path == tmp_path.resolve() / "rel"


def test_each_stage_gets_its_own_frozen_part_of_the_settings_from_the_stage_table(tmp_path):
    """config/stage_settings.py: the stage table hands each stage process only the sections
    it reads, frozen; local workers each get their own [[workers]] group, numbered across the
    groups; the epoch is not among them (the supervisor passes it as an argument)."""
    from assembly.stages import stage_specs

    path = tmp_path / "broker.toml"
    path.write_text(
        f'[broker]\ndata_dir = "{tmp_path / "data"}"\n[api]\nenabled = true\n'
        '[[workers]]\nmodel = "a"\ncount = 1\n[[workers]]\nmodel = "b"\ncount = 2\n'
        '[[models]]\nname = "a"\nengine = "echo"\n[[models]]\nname = "b"\nengine = "simulated"\n'
    )
    settings = load_settings(path)
    views = {spec.label: spec.settings for spec in stage_specs(settings)}
    assert {type(v).__name__ for v in views.values()} == {
        f"{name}StageSettings"
        for name in (
            "Front", "Tokenizer", "Router", "Writer", "Dispatch", "Completion", "Vector", "Api",
            "Worker",
        )
    }  # fmt: skip
    completion = views["completion-0"]
    assert completion.max_attempts == settings.dispatch.max_attempts
    assert not hasattr(completion, "ingest") and not hasattr(completion, "models")
    assert views["api-0"].ingest_bind == settings.ingest.bind
    assert all(v.data_path == settings.data_path for v in views.values())
    assert [(views[f"worker-{i}"].model, views[f"worker-{i}"].model_engine) for i in range(3)] == [
        ("a", "echo"),
        ("b", "simulated"),
        ("b", "simulated"),
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        views["dispatch-0"].dispatch = settings.dispatch  # type: ignore[misc]
    assert not any(hasattr(v, "epoch") for v in views.values())
