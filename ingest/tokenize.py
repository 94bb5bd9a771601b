"""Per-model tokenizers for text input, and the step that tokenises a chunk.

    tokenizers = load_tokenizers(settings)               # one per model with a tokenizer
    chunk = tokenize_chunk(chunk, tokenizers, settings)  # text items -> tokens, or errors

A `ModelTokenizer` wraps `tokenizers.Tokenizer.from_file(model.tokenizer)`
with truncation and padding turned off, whatever the file says, so an
over-long prompt is seen whole and refused (`prompt_too_long`) instead of
being cut silently. Texts are encoded with `encode_batch_fast` (special
tokens added, no offsets) and come back as one flat uint32 array plus
offsets. Chat messages are rendered with the model's own chat template when its
tokenizer_config.json has one, else with the role-tag template (ingest/chat_template.py).

`encode_batch_fast` runs on the tokenizers library's own thread pool
(RAYON_NUM_THREADS threads; the library's default is one per core). Each
tokeniser process calls `share_cores(processes)` before its first encode,
which sets RAYON_NUM_THREADS (unless the environment already does) to its
share of the usable cores, so `[ingest] processes` tokenisers together run
one encoding thread per core: with the library's default, every process ran
a pool as large as the machine, one process already filled the cores and a
second only added contention. Load tokenizers in the process that uses them
(after a fork, not before).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from config.settings import ModelSettings
from config.stage_settings import Catalogued
from ingest.catalog import CHAT_COMPLETIONS, RESPONSES, prompt_limit_tokens
from ingest.chat_template import NativeTemplate, render_role_tags
from ingest.input_chunk import InputChunk, TokenGroup
from ingest.line_errors import (
    EMPTY_PROMPT,
    LINE_TOO_MANY_TOKENS,
    PROMPT_TOO_LONG,
    LineError,
    show,
)
from ingest.line_parser import TEXT_FIELD, too_many_tokens
from ingest.line_prompts import TextPrompt
from pipeline.core.errors import TokenizerError
from pipeline.core.ragged import offsets_of

_IDS = attrgetter("ids")


class ModelTokenizer:
    """One model's tokenizer: texts or chat messages in, flat uint32 tokens and offsets out."""

    def __init__(
        self, model: str, tokenizer: Tokenizer, path: Path, render=render_role_tags
    ) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.model = model
        self.path = path
        self._tokenizer = tokenizer
        self.render = render

    @classmethod
    def load(cls, model: ModelSettings, base_dir: Path | None = None) -> ModelTokenizer:
        """Load `model.tokenizer` (relative paths against `base_dir`, default the cwd).

        Raises TokenizerError naming the model and the path if the model has
        no tokenizer, the file is missing or unreadable, or the model serves
        chat and its tokenizer_config.json is unreadable or has a template that does not
        compile.
        """
        if not model.tokenizer:
            raise TokenizerError(
                f'model {model.name!r} has tokenizer = "" (token ids only); set '
                "tokenizer to the path of its tokenizer.json to take text input"
            )
        path = (base_dir or Path.cwd()) / Path(model.tokenizer).expanduser()
        fix = f"set tokenizer for model {model.name!r} to a readable tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"model {model.name!r}: tokenizer file {path} does not exist or is not a file; {fix}"
            )
        try:
            tokenizer = Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise TokenizerError(
                f"model {model.name!r}: cannot load tokenizer file {path} ({exc}); {fix}"
            ) from exc
        render = render_role_tags
        if CHAT_COMPLETIONS in model.endpoints or RESPONSES in model.endpoints:
            render = _chat_renderer(model.name, path)
        return cls(model.name, tokenizer, path, render)

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `texts`: flat uint32 tokens, and int64 offsets (len(texts) + 1)."""
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=True)
        # no Python loop per text: len() and .ids are mapped in C, the ids flattened by fromiter
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        offsets = offsets_of(lengths)
        ids = chain.from_iterable(map(_IDS, encodings))
        tokens = np.fromiter(ids, dtype=np.uint32, count=int(offsets[-1]))
        return tokens, offsets

    def encode_prompts(self, prompts: Sequence[TextPrompt]) -> tuple[np.ndarray, np.ndarray]:
        """`encode` for parsed prompts: strings as they are, chat messages rendered first."""
        if all(map(isinstance, prompts, repeat(str))):  # text only: no loop in Python
            return self.encode(prompts)
        return self.encode([p if isinstance(p, str) else self.render(p) for p in prompts])


def share_cores(processes: int, cores: int | None = None) -> int:
    """Set RAYON_NUM_THREADS to this process's share of the cores (at least 1); return it.

    A RAYON_NUM_THREADS already in the environment (set by the operator) is
    kept. Call before the first encode: the library sizes its pool then.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // max(1, processes))
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    return int(os.environ["RAYON_NUM_THREADS"])


def load_tokenizers(
    settings: Catalogued, base_dir: Path | None = None
) -> dict[str, ModelTokenizer]:
    """A `ModelTokenizer` for every model that has a tokenizer configured, by model name."""
    return {m.name: ModelTokenizer.load(m, base_dir) for m in settings.models if m.tokenizer}


def tokenize_chunk(
    chunk: InputChunk,
    tokenizers: Mapping[str, ModelTokenizer],
    settings: Catalogued,
    *,
    strict: bool = False,
) -> InputChunk:
    """`chunk` with its text items tokenised; those too long or empty become error records.

    A prompt longer than its model's `max_tokens` (or the largest lane)
    gets `prompt_too_long`, one of 0 tokens `empty_prompt`. With `strict`,
    the chunk's first error raises InputLineError. Raises TokenizerError if
    a model in the chunk has no entry in `tokenizers`.
    """
    if not chunk.needs_tokenizing:
        return _strict(chunk) if strict else chunk
    items = chunk.text_items
    item_models = chunk.model_index[items]
    groups = []
    for m in np.unique(item_models).tolist():
        name = chunk.models[m]
        tokenizer = tokenizers.get(name)
        if tokenizer is None:
            raise TokenizerError(
                f"no tokenizer loaded for model {name!r}; load one per model with "
                "ingest.tokenize.load_tokenizers(settings)"
            )
        picked = np.flatnonzero(item_models == m)
        if len(picked) == len(items):  # one model (the usual chunk): its texts as they are
            tokens, offsets = tokenizer.encode_prompts(chunk.texts)
        else:
            tokens, offsets = tokenizer.encode_prompts([chunk.texts[j] for j in picked.tolist()])
        groups.append(TokenGroup(items[picked], tokens, offsets))
    tokenized = chunk.with_tokens(groups)
    largest_lane = settings.broker.lanes[-1]
    by_name = {m.name: m for m in settings.models}
    limits = np.array([prompt_limit_tokens(by_name[m], largest_lane) for m in chunk.models])
    lengths = tokenized.lengths[items]
    bad = (lengths == 0) | (lengths > limits[item_models])
    errors, reported = [], set()
    for j in np.flatnonzero(bad).tolist():  # one error per line, its first bad part's
        line = int(chunk.line[items[j]])
        if line not in reported:
            reported.add(line)
            errors.append(
                _length_error(chunk, int(items[j]), int(lengths[j]), int(limits[item_models[j]]))
            )
    drop = np.zeros(chunk.n_items, dtype=bool)
    drop[items[bad]] = True
    if chunk.fanout:
        errors += _over_budget(tokenized, drop, settings.ingest.max_line_tokens)
    result = tokenized.without(drop, errors)
    return _strict(result) if strict else result


def _over_budget(chunk: InputChunk, drop: np.ndarray, budget: int) -> list[LineError]:
    """`line_too_many_tokens` for each line not yet dropped whose parts' prompts together
    exceed `budget` tokens (ingest.max_line_tokens); marks them in `drop`."""
    line = chunk.line.astype(np.int64)
    starts = np.flatnonzero(np.r_[True, np.diff(line) != 0])
    totals = np.add.reduceat(chunk.lengths.astype(np.int64), starts)
    errors = []
    for k in np.flatnonzero(totals > budget).tolist():
        first = int(starts[k])
        if drop[first]:
            continue
        reason = too_many_tokens(int(totals[k]), budget)
        errors.append(
            LineError.at(int(line[first]), chunk.custom_ids[first], LINE_TOO_MANY_TOKENS, reason)
        )
        drop[line == line[first]] = True
    return errors


def _length_error(chunk: InputChunk, item: int, n_tokens: int, limit: int) -> LineError:
    line, custom_id = int(chunk.line[item]), chunk.custom_ids[item]
    model = chunk.models[chunk.model_index[item]]
    field = TEXT_FIELD[chunk.shapes[chunk.shape_index[item]].endpoint]
    if n_tokens == 0:
        reason = f"body.{field} tokenises to no tokens for model {show(model)}; send some text"
        return LineError.at(line, custom_id, EMPTY_PROMPT, reason)
    reason = (
        f"body.{field} tokenises to {n_tokens} tokens; model {show(model)} takes at most "
        f"{limit}: shorten the prompt"
    )
    return LineError.at(line, custom_id, PROMPT_TOO_LONG, reason)


def _strict(chunk: InputChunk) -> InputChunk:
    if chunk.errors:
        raise chunk.errors[0].to_exception()
    return chunk


def _chat_renderer(model: str, path: Path):
    """The model's own chat template when its tokenizer_config.json has one, else role tags."""
    config = path.with_name("tokenizer_config.json")
    try:
        values = json.loads(config.read_text("utf-8"))
    except FileNotFoundError:
        return render_role_tags
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"model {model!r}: cannot read {config} ({exc}); fix or remove that file"
        ) from exc
    if isinstance(values, dict) and isinstance(values.get("chat_template"), str):
        return NativeTemplate(model, config, values)
    return render_role_tags
