"""The decoders of a broker's models: generated token ids -> text, for every door's output lines.

    decoders = model_decoders(settings)   # {model name: decode(token_ids) -> str}
    client.fetch(job, out, err, decoders=decoders)

Each door that writes output lines renders generated text with these: `run.py
results` (run.py), `run.py batch` (cli/batch.py) and the HTTP API's
batch driver (api/batch_driver.py), so `message.content`, `text` and
`output_text` are the same text whichever door a job's results leave by. A
model without a tokenizer gets no decoder: its lines carry `token_ids` and an
empty text (collector/delivery/lines.py). A tokenizer path is read as the
tokenizer stage reads it (relative to the working directory); a client host
without the file renders that model's text empty, as without a tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from config.stage_settings import Modelled
from pipeline.core.errors import TokenizerError

Decoder = Callable[[list[int]], str]


def model_decoders(settings: Modelled) -> dict[str, Decoder]:
    """A decoder for each model of `settings` whose tokenizer file is here, by model name."""
    from tokenizers import Tokenizer  # loaded only by doors that render text

    decoders: dict[str, Decoder] = {}
    for model in settings.models:
        if not model.tokenizer:
            continue
        path = Path(model.tokenizer).expanduser()
        if not path.is_file():
            continue
        try:
            tokenizer = Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise TokenizerError(
                f"model {model.name!r}: cannot load tokenizer file {path} to decode its "
                f"results ({exc}); set tokenizer for model {model.name!r} to a readable "
                "tokenizer.json"
            ) from exc
        decoders[model.name] = tokenizer.decode
    return decoders
