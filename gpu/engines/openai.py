"""The `openai` engine: an OpenAI-compatible server (vLLM's, SGLang, TEI, llama.cpp, Ollama) as
the engine.

The broker keeps durability, lanes, deadlines and exactly-once; the server keeps its own
batching. Each item of a batch is one request (`POST base_url + /completions` for a
generate batch, `/embeddings` for an embed batch), sent from a small pool of threads; how
many are in flight at once is `AimdGate`'s limit (gpu/engines/aimd.py): one more per round
of good answers, half on a 429, a 5xx, a connection fault or an answer slower than
`latency_target_ms`.

| item's prompt        | sent as                                                        |
|----------------------|----------------------------------------------------------------|
| `prompt = "tokens"` (default) | its token ids (`"prompt": [ids]`, `"input": [ids]`): the chat template was applied at ingest, so chat, completions and responses lines all go to `/completions` |
| `prompt = "text"`    | the ids decoded with `tokenizer` (special tokens kept as text), for servers that take no ids |

| answer                | the item                                                         |
|-----------------------|------------------------------------------------------------------|
| 2xx                   | generate: the answer's text, tokenised with `tokenizer` (the broker decodes it back at delivery); embed: the vector. Prompt tokens are the upstream's `usage.prompt_tokens` |
| another 4xx (400, 422) | that item's own error, with the upstream's message; the rest go on |
| 429, 5xx, connection refused / reset / cut, no byte for `timeout_s` | retried, the same request, after `Retry-After` or an exponential backoff with jitter, for at most `retry_for_s` in all; then the whole batch is a `TransientEngineError`: handed back without an attempt, the worker backs off |
| 401, 403, 404         | `UpstreamRefused`: the engine is misconfigured (the worker exits 7 and hands back) |

A retried request is the same item: its one answer is the item's one result. An item of no
tokens, past its lane, or with an id outside the tokenizer's vocabulary is refused before
sending (`item_errors`); a prompt too long is the server's 400. The server's own out of memory
is a 5xx like any other (the batch goes back whole, never split).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from gpu.engines.aimd import AimdGate
from gpu.engines.base import (
    EMBED,
    GENERATE,
    Engine,
    EngineBatch,
    EngineError,
    EngineResult,
    TransientEngineError,
)
from gpu.engines.generation import Sampling, item_errors, pack
from gpu.engines.upstream import ItemRefused, PushBack, Upstream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PROMPTS = ("tokens", "text")
ANY_ID = 2**32  # no tokenizer: every uint32 id is sent, and the server judges it
NO_CONTEXT_LIMIT = 2**62  # the server knows its context; a prompt too long is its 400
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class _GaveUp:
    """An item's request that still had no answer when the batch's retry time ran out."""

    def __init__(self, reason: str, first: bool = False) -> None:
        self.reason = reason
        self.first = first  # the request whose retries ran out (the others stopped with it)


class OpenAIEngine(Engine):
    """A client of an OpenAI-compatible server; see the module docstring."""

    name = "openai"
    wants_full_batches = True  # up to max_concurrency of its items in flight at once

    def __init__(
        self,
        base_url: str = "",
        model: str = "",
        api_key_env: str = "",
        tokenizer: str = "",
        prompt: str = "tokens",
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        retry_for_s: float = 60.0,
        max_concurrency: int = 16,
        start_concurrency: int = 4,
        latency_target_ms: float = 0.0,
    ) -> None:
        if not base_url or not model:
            raise EngineError(
                "openai engine: base_url and model are required; e.g. run.py worker --engine "
                "openai --option base_url=http://127.0.0.1:8000/v1 --option model=NAME"
            )
        if prompt not in PROMPTS:
            raise EngineError(f"openai engine: prompt = {prompt!r}; set tokens or text")
        for key, value in (("timeout_s", timeout_s), ("retry_for_s", retry_for_s)):
            if float(value) <= 0:
                raise EngineError(f"openai engine: {key} = {value} must be > 0")
        if int(max_concurrency) < 1 or float(latency_target_ms) < 0:
            raise EngineError(
                f"openai engine: max_concurrency = {max_concurrency} must be >= 1 and "
                f"latency_target_ms = {latency_target_ms} >= 0"
            )
        api_key = None
        if api_key_env:
            api_key = os.environ.get(str(api_key_env))
            if not api_key:
                raise EngineError(
                    f"openai engine: api_key_env = {api_key_env!r} but that environment "
                    "variable is unset or empty; export the key there"
                )
        self.model = str(model)
        self.prompt = prompt
        self.tokenizer_path = str(tokenizer)
        self.retry_for_s = float(retry_for_s)
        self.upstream = Upstream(str(base_url), api_key, float(timeout_s), float(connect_timeout_s))
        self.gate = AimdGate(int(max_concurrency), int(start_concurrency), latency_target_ms / 1e3)
        self.retries = 0  # requests sent again after a push-back (a figure)
        self.not_before = 0.0  # monotonic: the upstream's Retry-After holds every request
        self._tokenizer: Tokenizer | None = None
        self.vocab_size: int | None = None  # the tokenizer's ids; None: no tokenizer
        self.dimensions = 1  # the upstream's vectors' size, once one came (an all-errored batch's)
        self._pool: ThreadPoolExecutor | None = None

    def load(self) -> None:
        if self.tokenizer_path:
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(self.tokenizer_path)
            except Exception as exc:  # tokenizers raises its own Exception type
                raise EngineError(
                    f"openai engine: cannot read tokenizer {self.tokenizer_path!r} ({exc}); give "
                    "the model's tokenizer.json (the one its [[models]] entry names)"
                ) from None
            self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._pool = ThreadPoolExecutor(self.gate.maximum, thread_name_prefix="upstream")

    def close(self) -> None:
        """Stop the request threads and close their connections."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.upstream.close_all()

    def figures(self) -> dict:
        """What the worker reports about the engine (docs/metrics.md)."""
        return {"concurrency": self.gate.allowed, "upstream_retries": self.retries}

    # ---- one batch ---------------------------------------------------------------------------
    def infer(self, batch: EngineBatch) -> EngineResult:
        if self._pool is None:
            raise EngineError("openai engine: run() before load()")
        n = len(batch.lengths)
        if batch.task == GENERATE and self._tokenizer is None:
            raise EngineError(
                "openai engine: a generate batch needs the tokenizer option (the model's "
                "tokenizer.json) to carry the upstream's text to delivery"
            )
        path = "/completions" if batch.task == GENERATE else "/embeddings"
        bodies: list[dict | None] = []
        errors = item_errors(batch, self.vocab_size or ANY_ID, NO_CONTEXT_LIMIT, self.name)
        for i in range(n):
            made = errors[i] or self._body(batch, i)
            if isinstance(made, str):
                errors[i] = made
            bodies.append(None if isinstance(made, str) else made)
        deadline = time.monotonic() + self.retry_for_s
        gave_up = threading.Event()
        futures = [
            None if body is None else self._pool.submit(self._ask, path, body, deadline, gave_up)
            for body in bodies
        ]
        answers = [None if f is None else f.result() for f in futures]
        lost = next((a for a in answers if isinstance(a, _GaveUp) and a.first), None)
        if lost is not None or any(isinstance(a, _GaveUp) for a in answers):
            lost = lost or _GaveUp("retries stopped")
            raise TransientEngineError(
                f"openai engine: {self.upstream.base_url} gave no answer within retry_for_s "
                f"{self.retry_for_s:g} s ({lost.reason}); the batch of {n} items is handed back "
                "without counting an attempt"
            )
        prompt_tokens = batch.lengths.astype(np.uint32).copy()
        for i, answer in enumerate(answers):
            if isinstance(answer, str):
                errors[i] = answer
            elif isinstance(answer, dict):
                usage = answer.get("usage") or {}
                if isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] >= 0:
                    prompt_tokens[i] = usage["prompt_tokens"]
        if batch.task == EMBED:
            return self._embeddings(answers, errors, prompt_tokens)
        return self._generated(answers, errors, prompt_tokens, bool(Sampling.of(batch).stop))

    def _body(self, batch: EngineBatch, i: int) -> dict | str:
        """Item i's request body, or its error (an item `item_errors` passed)."""
        ids = batch.tokens[i, : int(batch.lengths[i])].tolist()
        prompt = ids
        if self.prompt == "text":
            if self._tokenizer is None:
                return "openai engine: prompt = text needs the tokenizer option"
            prompt = self._tokenizer.decode(ids, skip_special_tokens=False)
        if batch.task == EMBED:
            return {"model": self.model, "input": prompt}
        sampling = Sampling.of(batch)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(batch.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            body["seed"] = int(sampling.seed)
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)  # vLLM's, SGLang's extension
        return body

    def _ask(self, path: str, body: dict, deadline: float, gave_up: threading.Event):
        """One item's answer (a dict), its error (a str), or `_GaveUp`: retried on push-back,
        after Retry-After or a jittered exponential backoff, until `deadline`."""
        backoff_s = FIRST_BACKOFF_S
        while True:
            wait = self.not_before - time.monotonic()
            if wait > 0 and gave_up.wait(min(wait, max(0.0, deadline - time.monotonic()))):
                return _GaveUp("another request of the batch gave up")
            started = self.gate.acquire(give_up=gave_up.is_set)
            if started is None:
                return _GaveUp("another request of the batch gave up")
            try:
                answer = self.upstream.post(path, body)
            except PushBack as exc:
                self.gate.release(started, ok=False)
                if exc.retry_after_s is not None:
                    pause = exc.retry_after_s * (1.0 + 0.2 * random.random())
                    self.not_before = max(self.not_before, time.monotonic() + exc.retry_after_s)
                else:
                    pause = backoff_s * (0.5 + random.random())
                    backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)
                if time.monotonic() + pause > deadline or gave_up.is_set():
                    first = not gave_up.is_set()
                    gave_up.set()  # the batch goes back whole: stop the others' retries
                    return _GaveUp(str(exc), first)
                self.retries += 1
                if gave_up.wait(pause):
                    return _GaveUp("another request of the batch gave up")
                continue
            except ItemRefused as exc:
                self.gate.release(started, ok=True)  # the server is well; the item is not
                return str(exc)
            except BaseException:
                self.gate.release(started, ok=True)
                raise
            self.gate.release(started, ok=True)
            return answer

    # ---- answers -> result -------------------------------------------------------------------
    def _generated(self, answers, errors, prompt_tokens, stopped: bool) -> EngineResult:
        """The answers' texts as ids. With stop strings the server cut its text at the stop,
        maybe inside a token: the ids kept are those whose text is the answer's own, so a token
        the stop string began inside goes too (never an id for a piece of a word)."""
        outputs: list[np.ndarray | None] = [None] * len(answers)
        for i, answer in enumerate(answers):
            if errors[i] is not None or not isinstance(answer, dict):
                continue
            choices = answer.get("choices")
            text = choices[0].get("text") if isinstance(choices, list) and choices else None
            if not isinstance(text, str):
                errors[i] = f"upstream answer has no choices[0].text: {str(answer)[:300]}"
                continue
            assert self._tokenizer is not None  # a generate batch is refused above without one
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            if stopped:
                ids = ids[: self._kept(ids, text)]
            outputs[i] = np.asarray(ids, np.uint32)
        tokens, offsets = pack(outputs)
        return EngineResult(errors, tokens=tokens, offsets=offsets, prompt_tokens=prompt_tokens)

    def _kept(self, ids: list[int], text: str) -> int:
        """How many of `ids` (`text` tokenised) decode to a prefix of `text`."""
        assert self._tokenizer is not None
        keep = len(ids)
        while keep and not text.startswith(self._tokenizer.decode(ids[:keep])):
            keep -= 1  # a cut word tokenised as something else (an unknown id, another piece)
        return keep

    def _embeddings(self, answers, errors, prompt_tokens) -> EngineResult:
        vectors: list[list | None] = [None] * len(answers)
        for i, answer in enumerate(answers):
            if errors[i] is not None or not isinstance(answer, dict):
                continue
            data = answer.get("data")
            vector = data[0].get("embedding") if isinstance(data, list) and data else None
            if not isinstance(vector, list) or not vector:
                errors[i] = f"upstream answer has no data[0].embedding: {str(answer)[:300]}"
                continue
            vectors[i] = vector
        dims = {len(v) for v in vectors if v is not None}
        if len(dims) > 1:
            raise TransientEngineError(
                f"openai engine: the upstream's vectors differ in size ({sorted(dims)}) within "
                "one batch; the batch is handed back"
            )
        dim = self.dimensions = dims.pop() if dims else self.dimensions
        out = np.zeros((len(answers), dim), np.float32)
        for i, vector in enumerate(vectors):
            if vector is not None:
                out[i] = vector
        return EngineResult(errors, embeddings=out, prompt_tokens=prompt_tokens)
