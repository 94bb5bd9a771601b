"""Per-token log probabilities while `transformers` generates, for shapes with `top_logprobs`.

`LogprobRecorder` is a logits processor placed first, so it sees the
model's raw logits at each step (before a sampler narrows them): it keeps
that step's log-softmax (one [rows, vocab] float32 tensor), its k best ids
and their log probabilities. The token chosen at a step is known only at the
next call (the last column of `input_ids`) or, for the final step, from the
returned sequences (`finish`), so the chosen token's log probability is
gathered then. Memory stays one step's log-softmax whatever `max_tokens`.

The log probabilities are the model's own distribution (temperature and
top_p do not change them), as vLLM gives by default.
"""

from __future__ import annotations

import numpy as np


class LogprobRecorder:
    def __init__(self, torch, top: int) -> None:
        self.torch = torch
        self.top = top
        self._last = None  # the previous step's log-softmax [rows, vocab]
        self._chosen: list = []  # per step: [rows]
        self._top_ids: list = []  # per step: [rows, k]
        self._top_logprobs: list = []

    def __call__(self, input_ids, scores):
        if self._last is not None:
            self._chosen.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        logprobs = self.torch.log_softmax(scores.float(), dim=-1)
        if self.top:
            values, ids = logprobs.topk(self.top, dim=-1)
            self._top_ids.append(ids)
            self._top_logprobs.append(values)
        self._last = logprobs
        return scores

    def finish(self, sequences) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logprobs [rows, steps], top ids [rows, steps, k], top logprobs) once generate
        returned `sequences` (its last column is the final step's choice)."""
        torch = self.torch
        if self._last is not None:
            self._chosen.append(self._last.gather(1, sequences[:, -1:]).squeeze(1))
            self._last = None
        rows = sequences.shape[0]
        steps = len(self._chosen)
        chosen = (
            torch.stack(self._chosen, dim=1).cpu().numpy()
            if steps
            else np.zeros((rows, 0), np.float32)
        )
        if self.top and steps:
            ids = torch.stack(self._top_ids, dim=1).cpu().numpy().astype(np.uint32)
            values = torch.stack(self._top_logprobs, dim=1).cpu().numpy()
        else:
            ids = np.zeros((rows, steps, self.top), np.uint32)
            values = np.zeros((rows, steps, self.top), np.float32)
        return chosen.astype(np.float32), ids, values.astype(np.float32)


def pack_logprobs(outputs: list[tuple | None], top: int) -> tuple[np.ndarray, ...]:
    """Per-item (logprobs [m], top ids [m, k], top logprobs [m, k]) or None (an item error) ->
    flat arrays aligned with `generation.pack`'s tokens."""
    parts = [o for o in outputs if o is not None]
    if not parts:
        return (
            np.zeros(0, np.float32),
            np.zeros((0, top), np.uint32),
            np.zeros((0, top), np.float32),
        )
    logprobs = np.concatenate([p[0] for p in parts]).astype(np.float32)
    m = len(logprobs)  # not -1: with top = 0 (logprobs without alternatives) it is ambiguous
    return (
        logprobs,
        np.concatenate([p[1] for p in parts]).astype(np.uint32).reshape(m, top),
        np.concatenate([p[2] for p in parts]).astype(np.float32).reshape(m, top),
    )


def from_vllm(steps, tokens: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """(logprobs [m], top ids [m, top], top logprobs) of the m kept `tokens` from vLLM's
    `CompletionOutput.logprobs`: per step a dict token id -> Logprob(logprob, rank, ...) that
    holds the sampled token and the `top` best (rank 1 .. top)."""
    m = len(tokens)
    chosen = np.zeros(m, np.float32)
    ids = np.zeros((m, top), np.uint32)
    values = np.full((m, top), -9999.0, np.float32)  # finite, should vLLM ever give fewer
    for t, (token, step) in enumerate(zip(np.asarray(tokens).tolist(), steps, strict=False)):
        chosen[t] = step[token].logprob
        best = sorted(step.items(), key=lambda item: -item[1].logprob)
        ranked = [item for item in best if getattr(item[1], "rank", 1) <= top][:top]
        for j, (other, value) in enumerate(ranked):
            ids[t, j], values[t, j] = other, value.logprob
    return chosen, ids, values
