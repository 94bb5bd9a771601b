"""What the tests that run vLLM for real share: the skip (or failure) where vLLM is missing,
their marks, the in-process engines, and one broker with a `vllm` worker.

A vLLM engine start costs half a minute of CPU on 2 cores (eager: no graph compilation), and
an idle engine still takes a share of a core (its CPU workers poll), so the real runs are one
pytest-xdist group (`vllm`, in `VLLM_MARKS`: one test process runs them all, one after the
other), ordered by module (`ORDER`; tests/conftest.py `pytest_collection_modifyitems`) so
that each engine starts once and ends once its last user is done (`close_all`, called by
tests/conftest.py as the group ends):

| step | modules | vLLM engines alive |
|------|---------|--------------------|
| 1 | test_vllm_engine, test_engine_contract | the in-process engines (`started`): generate and pooling |
| 2 | test_vllm_broker | the shared broker's worker (`vllm_broker`); vLLM's offline answers were taken from `started("generate")` before it started, which then closed |
| 3 | test_doors (its vllm case) | the shared broker's worker, and the batch door's private broker's |
| 4 | test_openai_vllm | vLLM's own OpenAI server (the shared broker closed first) |

At most two engines at once: on the CPU build each reserves 0.1 of the host's RAM.
Every engine, in process or a worker, has the same options (`engine_options`), so the
in-process engine is vLLM's offline `LLM` for the same model run the same way as the workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

EXPECT_ENV = "FABRIC_EXPECT_VLLM"  # "1" on a host with vLLM: its real runs fail, never skip
START_S = 600  # the most a test waits for a vLLM start on a loaded 2-core host
GROUP = "vllm"  # the pytest-xdist group of every real vLLM run
# The group's modules in the order they run (the module docstring's steps).
ORDER = ("test_vllm_engine", "test_engine_contract", "test_vllm_broker", "test_doors")
ORDER += ("test_openai_vllm",)
GENERATE_MODEL = os.environ.get("FABRIC_VLLM_MODEL", "smollm2")
EMBED_MODEL = os.environ.get("FABRIC_VLLM_EMBED_MODEL", "smollm2")


def missing_vllm() -> str | None:
    """Why the real vLLM runs cannot run here (None when they can)."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vllm is not installed in this Python (GPU hosts: pip install vllm; without a GPU "
            "its CPU build: the README's test command installs it); the real vLLM runs are "
            "skipped"
        )
    return None


def require_vllm_host() -> None:
    """Skips a real vLLM run where vLLM is missing, with the reason; where it must run (CI,
    or FABRIC_EXPECT_VLLM=1) fails instead."""
    reason = missing_vllm()
    if reason is None:
        return
    if os.environ.get(EXPECT_ENV) == "1" or os.environ.get("CI"):
        pytest.fail(f"CI or {EXPECT_ENV}=1 says this host runs vLLM, but {reason.split(';')[0]}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def vllm_host() -> None:
    """Skips a real vLLM run where vLLM is missing (`require_vllm_host`); bound in
    tests/conftest.py, so every module sees it."""
    require_vllm_host()


VLLM_MARKS = (
    pytest.mark.vllm,  # `pytest -m vllm` runs only these
    pytest.mark.xdist_group(GROUP),  # one test process runs them all (the module docstring)
    pytest.mark.timeout(START_S + 600),
    pytest.mark.filterwarnings("ignore:::vllm"),
    pytest.mark.filterwarnings("ignore:::torch"),
    pytest.mark.filterwarnings("ignore:::transformers"),
    # vLLM's shut-down client leaves its zmq context to the garbage collector
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
)


def on_vllm(test):
    """Runs where vLLM is (see `vllm_host`), with `VLLM_MARKS`."""
    test = pytest.mark.usefixtures("vllm_host")(test)
    for mark in VLLM_MARKS:
        test = mark(test)
    return test


def engine_options(runner: str = "generate") -> dict:
    """The engine options of every engine the tests start, besides the model. On vLLM's CPU
    build: eager (a start without graph compilation: about 30 s instead of 100 on 2 cores)
    and float32 (greedy answers that do not depend on what shares their batch: in bfloat16 a
    batch of other items turned SmolLM2's "The prime number that" into "The prime number I");
    the memory share is the engine's own CPU default. On a GPU, a share of it each."""
    import torch

    options: dict = {"enforce_eager": True}
    if not torch.cuda.is_available():
        return options | {"dtype": "float32"}
    return options | {"gpu_memory_utilization": 0.3 if runner == "generate" else 0.2}


# ---- step 1: the in-process engines --------------------------------------------------------
_STARTED: dict = {}  # runner -> VllmEngine


def started(runner: str):
    """The in-process engine of `runner`, loaded once (until `close_started`)."""
    if runner not in _STARTED:
        from gpu.engines.registry import make_engine

        model = GENERATE_MODEL if runner == "generate" else EMBED_MODEL
        engine = make_engine("vllm", model=model, runner=runner, **engine_options(runner))
        engine.load()
        _STARTED[runner] = engine
    return _STARTED[runner]


def close_started() -> None:
    """Closes the engines `started` loaded (which shuts vLLM's engine processes down)."""
    while _STARTED:
        _STARTED.popitem()[1].close()


# ---- steps 2 and 3: one broker with a vllm worker -------------------------------------------
# Model `gen`, as tests/test_doors.py's collection names it, with a prompt limit and a
# vocabulary larger than SmolLM2's, so that a prompt past its context and an id past its
# vocabulary reach the worker (tests/test_vllm_broker.py); batches of 8 items at most, so that
# a job of 48 lines is several.
MODEL_TOML = """
[[models]]
name = "gen"
engine = "vllm"
tokenizer = "{tokenizer}"
max_tokens = 16384
vocab_size = 65536
aliases = [{aliases}]
[[workers]]
model = "gen"
target_batch_s = 0
batch_items = 8
options = {{{options}}}
"""


def model_toml(aliases: tuple[str, ...]) -> str:
    """The shared broker's model and worker tables (the batch door's config has the same)."""
    from gpu.engines.smollm2_dir import SMOLLM2, smollm2_cache_dir, write_smollm2_dir
    from gpu.engines.transformers import smollm2_tokenizer_path

    model = GENERATE_MODEL
    if model == SMOLLM2:  # the engine's own cache, written once (gpu/engines/smollm2_dir.py)
        model = str(write_smollm2_dir(smollm2_cache_dir()))
    tokenizer = smollm2_tokenizer_path()
    if GENERATE_MODEL != SMOLLM2 and (Path(model) / "tokenizer.json").is_file():
        tokenizer = Path(model) / "tokenizer.json"
    options = {"model": model, **engine_options()}
    shown = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    return MODEL_TOML.format(
        tokenizer=tokenizer, aliases=", ".join(f'"{a}"' for a in aliases), options=shown
    )


class SharedBroker:
    """The broker of steps 2 and 3 (`vllm_broker`), with the api on; `close` stops it."""

    def __init__(self, tmp: Path) -> None:
        from broker import Broker, free_port, write_config
        from test_doors import ALIASES

        self.api_port = free_port()
        api = f'[api]\nenabled = true\nbind = "127.0.0.1:{self.api_port}"\n'
        config = write_config(tmp, extra=api, workers=0)
        text = config.read_text().replace("[workers]\nlocal = 0\n", "")
        config.write_text(text + model_toml(ALIASES["gen"]))
        self.broker: Broker | None = Broker(config, stderr_path=tmp / "broker.err")

    def start(self):
        close_started()  # its offline answers taken (tests/test_vllm_broker.py `offline`)
        return self.broker.start(timeout_s=START_S)

    def close(self) -> None:
        """Stops the broker: it must stop cleanly, vLLM's engine processes must end with its
        worker (`Engine.close`), and its data dir must check clean. Once; then nothing."""
        from conftest import assert_check_clean, wait_for

        from pipeline.core import exitcodes

        b, self.broker = self.broker, None
        if b is None:
            return
        try:
            engines = engine_processes(b)
            assert engines, "the worker runs vLLM's engine processes"
            assert b.stop() == exitcodes.OK, b.stderr
            wait_for(
                lambda: not any(Path(f"/proc/{pid}").exists() for pid in engines),
                "vLLM's engine processes to end with the worker",
                timeout_s=60,
            )
        finally:
            b.close()
        assert_check_clean(b.data_dir)


def engine_processes(b) -> list[int]:
    """The pids of vLLM's engine processes under the broker's worker (its descendants)."""
    worker = b.pids()["worker-0"]
    found, todo = [], [worker]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == parent:
                    found.append(int(entry.name))
                    todo.append(int(entry.name))
    return found


_SHARED: list[SharedBroker] = []


@pytest.fixture(scope="session")
def vllm_broker(tmp_path_factory):
    """The one broker with a `vllm` worker of steps 2 and 3 (bound in tests/conftest.py):
    made at its first use, stopped by `close_all` as the group ends (or at the end of the
    session); its api's port is `api_port`."""
    require_vllm_host()
    shared = SharedBroker(tmp_path_factory.mktemp("vllm-broker"))
    broker = shared.start()  # killed and closed here if it does not come up
    _SHARED.append(shared)
    broker.api_port = shared.api_port
    yield broker
    close_all()


def close_all() -> None:
    """Ends every vLLM engine the group holds: the in-process ones and the shared broker."""
    close_started()
    while _SHARED:
        _SHARED.pop().close()
