"""What a stored or sent result is: its status (a result or an error) and its payload kind.

One definition for the worker SDK (which sends them), completion (which
checks and stores them in the flags word of its result log) and delivery
(which renders them as response lines):

| status     | value | meaning                                              |
|------------|-------|------------------------------------------------------|
| `RESULT`   | 0     | the engine's answer                                  |
| `ERROR`    | 1     | the item failed; the payload is the error's text     |

| kind      | value | payload                                              |
|-----------|-------|------------------------------------------------------|
| `TOKENS`  | 0     | generated token ids, little-endian u32               |
| `VECTOR`  | 1     | an embedding, little-endian f32                      |
| `TEXT`    | 2     | UTF-8 text: an error's `code: message`, or generated text |
| `TOKEN_LOGPROBS` | 3 | generated token ids with their log probabilities and alternatives (pipeline/core/token_logprobs.py), for a shape with `top_logprobs` |

The values are on disk (completion's result segments) and on the wire
(RESULTS messages): never renumber them. A reader that predates a kind
(a delivery client before `TOKEN_LOGPROBS`) renders it as `invalid_result`,
never as something else.
"""

from __future__ import annotations

from enum import IntEnum


class ResultStatus(IntEnum):
    RESULT = 0
    ERROR = 1


class ResultKind(IntEnum):
    TOKENS = 0
    VECTOR = 1
    TEXT = 2
    TOKEN_LOGPROBS = 3


STATUSES = frozenset(int(s) for s in ResultStatus)
KINDS = frozenset(int(k) for k in ResultKind)
