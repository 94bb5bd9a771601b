"""Result reuse's model fingerprint from the weights the front can see (ingest/weights_digest.py):
a local model directory's digest, kept across starts in the data dir, and the models whose
weights it cannot see (a Hugging Face id, remote workers, a fleet) that keep needing a
`revision`. On real files, settings from real config files, and a real front stage."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from broker import Broker, submit, write_config
from conftest import assert_check_clean, wait_for
from smollm2 import SMOL_TOML, model_dir, needs_model, shared_root
from test_reuse import bodies, run, write

from config import load_settings
from config.defaults import SMOLLM2_SHA256
from config.stage_settings import stage_settings
from ingest.front_stage import FrontStage
from ingest.weights_digest import CACHE_FILE, DigestCache, directory_sha256, served_weights
from pipeline.core import exitcodes
from pipeline.store.datadir import DataDir
from pipeline.store.reuse_store import REUSE_DIR

HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


def a_model_dir(path: Path) -> Path:
    """A model directory as vLLM and transformers read one, plus files that are not the model,
    every file modified an hour ago (not racily new: its digest is kept)."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(1 << 16))
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (path / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (path / "README.md").write_text("a model card\n")
    (path / ".cache").mkdir()
    (path / ".cache" / "download.json").write_text("{}")
    for file in path.rglob("*"):
        os.utime(file, ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    return path


def flip_a_byte(path: Path, mtime_ns: int) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))  # same size
    os.utime(path, ns=(mtime_ns, mtime_ns))


def fresh_digest(directory: Path, tmp_path: Path) -> str | None:
    """The directory's digest with no cache to take from."""
    cache = tmp_path / f"cache-{time.monotonic_ns()}.json"
    return directory_sha256(directory, DigestCache(cache))


def test_a_directory_digest_follows_its_weight_bytes_not_other_files_or_mtimes(tmp_path):
    directory = a_model_dir(tmp_path / "smol")
    first = fresh_digest(directory, tmp_path)
    assert first is not None and len(first) == 64

    (directory / "README.md").write_text("a longer model card, rewritten\n")
    (directory / "logo.png").write_bytes(b"\x89PNG")
    (directory / ".cache" / "download.json").write_text('{"etag": "x"}')
    weights = directory / "model.safetensors"
    os.utime(weights, ns=(HOUR_AGO_NS + 10**9, HOUR_AGO_NS + 10**9))  # touched, bytes equal
    assert fresh_digest(directory, tmp_path) == first

    flip_a_byte(weights, HOUR_AGO_NS + 2 * 10**9)
    changed = fresh_digest(directory, tmp_path)
    assert changed != first
    (directory / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    assert fresh_digest(directory, tmp_path) not in (first, changed)


def test_the_digests_are_kept_for_the_next_start_and_a_changed_file_is_read_again(
    tmp_path, monkeypatch
):
    directory = a_model_dir(tmp_path / "smol")
    reads: list[str] = []
    real = hashlib.file_digest

    def counted(f, digest):
        reads.append(Path(f.name).name)
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", counted)
    kept = tmp_path / "data" / "reuse" / CACHE_FILE
    cache = DigestCache(kept)
    first = directory_sha256(directory, cache)
    cache.save()
    assert sorted(reads) == ["config.json", "model.safetensors", "tokenizer.json"]

    reads.clear()  # a restart: nothing is read again
    assert directory_sha256(directory, DigestCache(kept)) == first
    assert reads == []

    flip_a_byte(directory / "model.safetensors", HOUR_AGO_NS + 5 * 10**9)
    cache = DigestCache(kept)
    changed = directory_sha256(directory, cache)
    cache.save()
    assert reads == ["model.safetensors"]
    assert changed != first and changed == fresh_digest(directory, tmp_path)

    reads.clear()  # a file modified just now is read again at the next start (racy mtime)
    (directory / "config.json").write_text('{"architectures": ["Now"]}')
    for _ in range(2):
        cache = DigestCache(kept)
        directory_sha256(directory, cache)
        cache.save()
    assert reads == ["config.json", "config.json"]


WORKERS = """
[broker]
data_dir = "data"
[[models]]
name = "smol"
engine = "transformers"
[[models]]
name = "pinned"
engine = "transformers"
[[models]]
name = "hub"
engine = "vllm"
[[models]]
name = "remote"
engine = "vllm"
[[models]]
name = "declared"
engine = "vllm"
revision = "2026-12-07"
[[workers]]
model = "smol"
engine = "transformers"
options = {model = "models/smol", dtype = "float32"}
[[workers]]
model = "pinned"
engine = "transformers"
[[workers]]
model = "hub"
engine = "vllm"
options = {model = "HuggingFaceTB/SmolLM2-135M-Instruct"}
[[workers]]
model = "declared"
engine = "vllm"
options = {model = "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""


def test_settings_from_a_config_file_give_local_weights_and_say_why_others_have_none(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the workers' `models/smol` is relative, as the front's cwd
    directory = a_model_dir(tmp_path / "models" / "smol")
    config = tmp_path / "fabric.toml"
    config.write_text(WORKERS)
    settings = load_settings(config)
    cache = DigestCache(tmp_path / "cache.json")
    models = {m.name: m for m in settings.models}

    def weights(name: str) -> tuple[str | None, str]:
        return served_weights(models[name], settings.worker_groups, settings.fleet, cache)

    smol, _ = weights("smol")
    assert smol == f"dir-sha256:{fresh_digest(directory, tmp_path)}|options:" + (
        '{"dtype": "float32"}'
    )
    assert weights("pinned") == (f"sha256:{SMOLLM2_SHA256}", "")
    hub, why = weights("hub")
    assert hub is None and "HuggingFaceTB/SmolLM2-135M-Instruct" in why
    remote, why = weights("remote")
    assert remote is None and "no local [[workers]]" in why
    assert weights("declared")[0] is None  # its revision is the weights: reuse_keys says it

    config.write_text(WORKERS + '[[fleet]]\nmodel = "smol"\nengine = "transformers"\n')
    settings = load_settings(config)
    fleet, why = served_weights(models["smol"], settings.worker_groups, settings.fleet, cache)
    assert fleet is None and "[[fleet]]" in why


def front_fingerprint(tmp_path: Path, directory: Path) -> str | None:
    """The fingerprint of model `smol` as a front stage opened on a real config computes it."""
    smol = '[[models]]\nname = "smol"\nengine = "transformers"\nendpoints = ["/v1/completions"]\n'
    path = write_config(
        tmp_path,
        workers=1,
        worker_keys=f'model = "smol"\nengine = "transformers"\noptions = {{model = "{directory}"}}',
        extra=smol,
    )
    settings = load_settings(path)
    DataDir(settings.data_path).ensure()
    stage = FrontStage(stage_settings(settings, "front"), 0)
    stage.open()
    try:
        return stage.reuse.fingerprints["smol"]
    finally:
        stage.close()


def test_the_front_fingerprints_a_model_directory_and_keeps_its_digests_in_the_data_dir(
    tmp_path,
):
    directory = a_model_dir(tmp_path / "smol")
    first = front_fingerprint(tmp_path, directory)
    assert first is not None and first.startswith("transformers|dir-sha256:")
    assert (tmp_path / "data" / REUSE_DIR / CACHE_FILE).is_file()

    (directory / "README.md").write_text("another card\n")
    assert front_fingerprint(tmp_path, directory) == first  # results stay reusable

    flip_a_byte(directory / "model.safetensors", HOUR_AGO_NS + 7 * 10**9)
    changed = front_fingerprint(tmp_path, directory)
    assert changed is not None and changed != first  # new weights: every line runs again


def test_status_says_why_a_reusing_job_s_model_never_reuses(tmp_path):
    """A `--reuse` job on a vllm model with no local workers and an openai one: their lines
    never reuse, and `status` names each model and why (no error: the lines are accepted and
    run as without --reuse)."""
    hub = (
        '[[models]]\nname = "hub"\nengine = "vllm"\nendpoints = ["/v1/completions"]\n'
        '[[models]]\nname = "up"\nengine = "openai"\nendpoints = ["/v1/completions"]\n'
    )
    config = write_config(tmp_path, extra=hub)  # no local workers: the lines wait
    lines = [
        {
            "custom_id": f"{model}{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": [1, 2, 3 + i], "max_tokens": 2, "temperature": 0},
        }
        for i in range(3)
        for model in ("hub", "up")
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    b = Broker(config).start()
    try:
        done = submit(config, path, "--reuse")
        assert done.returncode == exitcodes.OK, done.stderr
        job = done.stdout.strip().splitlines()[-1]
        off = wait_for(lambda: b.job_status(job).get("reuse_off"), "status's reuse_off")
        assert set(off) == {"hub", "up"}
        assert "no local [[workers]]" in off["hub"] and "revision" in off["hub"]
        assert "engine openai: the front cannot see" in off["up"]
        assert b.job_status(job)["reused"] == 0
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        b.close()
    assert_check_clean(b.data_dir)


@needs_model
def test_a_model_directory_served_by_a_local_transformers_worker_reuses_its_results(
    tmp_path, tmp_path_factory
):
    """End to end: a broker whose local worker loads SmolLM2 from a model directory (no
    `revision`); the same file run twice with --reuse: the second run takes every line from
    the index, with the first run's bodies."""
    from gpu.engines.transformers import smollm2_tokenizer_path

    weights = model_dir(shared_root(tmp_path_factory))
    config = write_config(
        tmp_path,
        workers=1,
        worker_keys=f'model = "smol"\nengine = "transformers"\n'
        f'options = {{model = "{weights}", threads = 1}}',
    )
    config.write_text(config.read_text() + SMOL_TOML.format(tokenizer=smollm2_tokenizer_path()))
    lines = [
        {
            "custom_id": f"s{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "smol",
                "prompt": f"Count to {i}:",
                "max_tokens": 3,
                "temperature": 0,
            },
        }
        for i in range(4)
    ]
    path = write(tmp_path / "in.jsonl", lines)
    b = Broker(config).start()
    try:
        first = run(b, path, tmp_path / "first.jsonl", "--reuse")
        assert first["reused"] == 0 and first["reuse_off"] is None
        second = run(b, path, tmp_path / "second.jsonl", "--reuse")
        assert second["reused"] == 4
        assert bodies(tmp_path / "second.jsonl") == bodies(tmp_path / "first.jsonl")
        assert b.stop() == exitcodes.OK, b.stderr
    finally:
        b.close()
    assert_check_clean(b.data_dir)
