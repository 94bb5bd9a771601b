"""Writes gpu/minilm/tokenizer.json from gpu/minilm/vocab.txt (run once; the output is committed).

    .venv/bin/python gpu/minilm/make_tokenizer.py

The tokenizer of all-MiniLM-L6-v2 is BERT's uncased WordPiece: clean the
text, split CJK characters, lowercase, strip accents, then `[CLS] ... [SEP]`
around the word pieces. Truncation is set explicitly to 256 tokens (the
model's `max_seq_length` in sentence-transformers) and padding is off: the
broker pads by lanes, and ingest turns truncation off as well so that an
over-long prompt is refused rather than cut (ingest/tokenize.py).

Run it again only if vocab.txt changes; the test suite checks the committed
file against the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers.implementations import BertWordPieceTokenizer

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 256


def build() -> BertWordPieceTokenizer:
    """The minilm tokenizer, built from the committed vocabulary."""
    tokenizer = BertWordPieceTokenizer(
        str(HERE / "vocab.txt"),
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=True,
        lowercase=True,
    )
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    tokenizer.no_padding()
    return tokenizer


def main() -> None:
    out = HERE / "tokenizer.json"
    build().save(str(out), pretty=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
