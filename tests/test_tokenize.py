"""Per-model tokenizers: flat uint32 arrays, no truncation, chat rendering, load errors, chunks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from config import load_settings
from ingest.batch_input import iter_batch_input
from ingest.chat_template import render_role_tags
from ingest.tokenize import ModelTokenizer, load_tokenizers, share_cores, tokenize_chunk
from pipeline.core.errors import InputLineError, TokenizerError

WORDS = (
    "the",
    "log",
    "is",
    "queue",
    "hello",
    "world",
    "once",
    "upon",
    "a",
    "time",
    "user",
    "system",
    "assistant",
)
VOCAB = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
ID = VOCAB.get


def build_tokenizer(path: Path, *, specials: bool = True, truncate_to: int | None = None) -> Path:
    """A tiny word-level tokenizer.json: whitespace words, [CLS] ... [SEP] around each text."""
    tokenizer = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    if specials:
        tokenizer.post_processor = TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
        )
    if truncate_to is not None:
        tokenizer.enable_truncation(truncate_to)
        tokenizer.enable_padding(pad_id=3, pad_token="[PAD]", length=32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def settings(tmp_path):
    plain = build_tokenizer(tmp_path / "plain" / "tokenizer.json", specials=False)
    return load_settings(
        None,
        {
            "models": [
                {
                    "name": "embedder",
                    "engine": "minilm",
                    "tokenizer": str(tmp_path / "tokenizer.json"),
                },
                {"name": "chat", "engine": "echo", "tokenizer": str(plain), "max_tokens": 12},
                {"name": "ids-only", "engine": "vllm"},
            ]
        },
    )


@pytest.fixture
def tokenizers(tmp_path, settings):
    build_tokenizer(tmp_path / "tokenizer.json")
    return load_tokenizers(settings)


def test_encode_gives_flat_uint32_tokens_and_offsets(tokenizers):
    tokens, offsets = tokenizers["embedder"].encode(["the log", "is the queue", "hello"])
    assert tokens.dtype == np.uint32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 4, 9, 12]
    assert tokens.tolist() == [
        1,
        ID("the"),
        ID("log"),
        2,
        1,
        ID("is"),
        ID("the"),
        ID("queue"),
        2,
        1,
        ID("hello"),
        2,
    ]


def test_encode_of_nothing_is_empty(tokenizers):
    tokens, offsets = tokenizers["embedder"].encode([])
    assert tokens.size == 0 and offsets.tolist() == [0]


def test_truncation_and_padding_in_the_file_are_turned_off(tmp_path, settings):
    build_tokenizer(tmp_path / "tokenizer.json", truncate_to=4)
    tokenizer = ModelTokenizer.load(settings.model("embedder"))
    _, offsets = tokenizer.encode(["once upon a time the log is the queue", "a"])
    assert offsets.tolist() == [0, 11, 14], "a long text must come back whole, a short one unpadded"


def test_chat_messages_render_with_role_tags():
    messages = (("system", "You are terse."), ("user", "Name a prime."))
    assert render_role_tags(messages) == (
        "<|system|>\nYou are terse.\n<|user|>\nName a prime.\n<|assistant|>\n"
    )


def test_encode_prompts_renders_chat_and_keeps_strings(tokenizers):
    chat = (("user", "hello world"),)
    tokenizer = tokenizers["chat"]
    tokens, offsets = tokenizer.encode_prompts(["hello", chat])
    expected_chat, _ = tokenizer.encode([render_role_tags(chat)])
    assert tokens[: offsets[1]].tolist() == [ID("hello")]
    assert tokens[offsets[1] :].tolist() == expected_chat.tolist()
    assert ID("user") in expected_chat.tolist() and ID("assistant") in expected_chat.tolist()


def test_a_model_without_a_tokenizer_is_refused_by_name(settings):
    with pytest.raises(TokenizerError, match=r"model 'ids-only' has tokenizer = \"\""):
        ModelTokenizer.load(settings.model("ids-only"))


def test_a_missing_tokenizer_file_names_the_model_and_the_path(tmp_path, settings):
    missing = tmp_path / "tokenizer.json"
    with pytest.raises(TokenizerError) as caught:
        ModelTokenizer.load(settings.model("embedder"))
    assert "model 'embedder'" in str(caught.value) and str(missing) in str(caught.value)
    assert "does not exist" in str(caught.value)


def test_an_unreadable_tokenizer_file_names_the_model_and_the_path(tmp_path, settings):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(
        TokenizerError, match=r"model 'embedder': cannot load tokenizer file .*tokenizer\.json"
    ):
        ModelTokenizer.load(settings.model("embedder"))


def test_a_relative_tokenizer_path_resolves_against_base_dir(tmp_path):
    build_tokenizer(tmp_path / "models" / "tokenizer.json")
    relative = load_settings(
        None, {"models": [{"name": "m", "engine": "minilm", "tokenizer": "models/tokenizer.json"}]}
    )
    tokenizer = ModelTokenizer.load(relative.model("m"), base_dir=tmp_path)
    assert tokenizer.path == tmp_path / "models" / "tokenizer.json"


def test_a_native_chat_template_prompts_chat_in_the_models_own_format(tmp_path, settings):
    build_tokenizer(tmp_path / "tokenizer.json")
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for folder in (tmp_path, tmp_path / "plain"):
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml}))
    ModelTokenizer.load(settings.model("embedder"))  # serves /v1/embeddings only
    chat = ModelTokenizer.load(settings.model("chat"))
    prompt = chat.render([("user", "w1 w2")])
    assert prompt == "<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% x"}))
    with pytest.raises(
        TokenizerError, match=r"model 'chat': the chat_template .* does not compile"
    ):
        ModelTokenizer.load(settings.model("chat"))
    (tmp_path / "plain" / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match=r"cannot read .*tokenizer_config\.json"):
        ModelTokenizer.load(settings.model("chat"))


def test_smollm2_chat_is_rendered_as_chatml_with_its_default_system_prompt():
    from config import load_settings

    settings = load_settings(
        None,
        {
            "models": [
                {
                    "name": "smol",
                    "engine": "transformers",
                    "tokenizer": "gpu/smollm2/tokenizer.json",
                    "endpoints": ["/v1/chat/completions"],
                }
            ]
        },
    )
    smol = ModelTokenizer.load(settings.model("smol"), base_dir=Path(__file__).parents[1])
    prompt = smol.render([("user", "Name a prime.")])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nName a prime.<|im_end|>\n<|im_start|>assistant\n")


def test_load_tokenizers_loads_one_per_model_with_a_tokenizer(tokenizers):
    assert sorted(tokenizers) == ["chat", "embedder"]


def line(custom_id: str, url: str, model: str, **body) -> bytes:
    request = {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, **body},
    }
    return json.dumps(request).encode() + b"\n"


def chunk_of(settings, *lines: bytes):
    [chunk] = list(iter_batch_input(io.BytesIO(b"".join(lines)), settings))
    return chunk


def test_tokenize_chunk_fills_text_items_between_token_items(settings, tokenizers):
    chunk = chunk_of(
        settings,
        line("e1", "/v1/embeddings", "embedder", input="the log"),
        line("t1", "/v1/completions", "ids-only", prompt_token_ids=[7, 8, 9]),
        line("c1", "/v1/chat/completions", "chat", messages=[{"role": "user", "content": "hello"}]),
        line("p1", "/v1/completions", "chat", prompt="once upon a time"),
        line("e2", "/v1/embeddings", "embedder", prompt_token_ids=[5]),
    )
    done = tokenize_chunk(chunk, tokenizers, settings)
    assert not done.needs_tokenizing and done.text_items.size == 0 and done.errors == ()
    assert done.custom_ids == chunk.custom_ids
    chat_tokens, _ = tokenizers["chat"].encode([render_role_tags((("user", "hello"),))])
    expected = [
        [1, ID("the"), ID("log"), 2],
        [7, 8, 9],
        chat_tokens.tolist(),
        [ID("once"), ID("upon"), ID("a"), ID("time")],
        [5],
    ]
    assert [
        done.tokens[a:b].tolist() for a, b in zip(done.offsets[:-1], done.offsets[1:], strict=True)
    ] == expected
    assert done.lengths.tolist() == [len(e) for e in expected]


def test_too_long_and_empty_text_prompts_become_errors_and_the_rest_stays_aligned(
    settings, tokenizers
):
    chunk = chunk_of(
        settings,
        line("ok-1", "/v1/completions", "chat", prompt="hello"),
        line("long", "/v1/completions", "chat", prompt="the log " * 7),  # 14 tokens > 12
        line("ids", "/v1/completions", "ids-only", prompt_token_ids=[1, 2]),
        line("blank", "/v1/completions", "chat", prompt="   "),  # no words, no special tokens
        line("ok-2", "/v1/embeddings", "embedder", input="queue"),
    )
    done = tokenize_chunk(chunk, tokenizers, settings)
    assert [(e.line, e.custom_id, e.code) for e in done.errors] == [
        (2, "long", "prompt_too_long"),
        (4, "blank", "empty_prompt"),
    ]
    assert done.errors[0].message == (
        'line 2 (custom_id "long"): body.prompt tokenises to 14 tokens; model "chat" takes '
        "at most 12: shorten the prompt"
    )
    assert done.custom_ids == ("ok-1", "ids", "ok-2")
    assert done.line.tolist() == [1, 3, 5]
    assert done.tokens.tolist() == [ID("hello"), 1, 2, 1, ID("queue"), 2]
    assert done.offsets.tolist() == [0, 1, 3, 6]


def test_tokenize_chunk_strict_raises_on_the_first_too_long_prompt(settings, tokenizers):
    chunk = chunk_of(
        settings,
        line("ok", "/v1/completions", "chat", prompt="hello"),
        line("long", "/v1/completions", "chat", prompt="a " * 13),
    )
    with pytest.raises(InputLineError) as caught:
        tokenize_chunk(chunk, tokenizers, settings, strict=True)
    assert (caught.value.line, caught.value.custom_id, caught.value.code) == (
        2,
        "long",
        "prompt_too_long",
    )


def test_tokenize_chunk_without_text_is_the_same_chunk(settings):
    chunk = chunk_of(settings, line("t", "/v1/completions", "ids-only", prompt_token_ids=[1]))
    assert tokenize_chunk(chunk, {}, settings) is chunk


def test_tokenize_chunk_needs_a_tokenizer_for_each_text_model(settings, tokenizers):
    chunk = chunk_of(settings, line("e", "/v1/embeddings", "embedder", input="the"))
    with pytest.raises(TokenizerError, match="no tokenizer loaded for model 'embedder'"):
        tokenize_chunk(chunk, {"chat": tokenizers["chat"]}, settings)


def test_tokeniser_processes_share_the_cores_instead_of_each_taking_them_all(monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    assert share_cores(2, cores=8) == 4 and os.environ["RAYON_NUM_THREADS"] == "4"
    monkeypatch.delenv("RAYON_NUM_THREADS")
    assert share_cores(3, cores=2) == 1  # never fewer than one thread
    monkeypatch.setenv("RAYON_NUM_THREADS", "6")  # the operator's choice is kept
    assert share_cores(2, cores=8) == 6
