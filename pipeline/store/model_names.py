"""What a model name (or an alias, or a vector store's name) may be.

A name is what an input line writes in `body.model` and what the output's
`model` repeats: OpenAI's and Hugging Face's ids must be writable as they
are (`gpt-4o-mini`, `meta-llama/Llama-3.1-8B-Instruct`,
`ft:gpt-4o-mini:org::id`), so a name is

* 1 to `MAX_NAME_BYTES` (64) characters, the size of a segment header's name
  field (pipeline/store/segment_format.py `NAME_BYTES`), where an input segment
  keeps its model's name;
* of letters, digits, '/', ':', '.', '_' and '-';
* not starting with '/' or '.', and with no '..' between slashes.

A name reaches files only through pipeline/core/file_names.py, which encodes its
'/' and ':'. `config/rules.py` checks model names and aliases with
`name_problem`, the vector stores check store names with it.
"""

from __future__ import annotations

import re
from typing import Final

from pipeline.store.segment_format import NAME_BYTES

MAX_NAME_BYTES: Final = NAME_BYTES
NAME_RULE: Final = (
    f"1 to {MAX_NAME_BYTES} characters of letters, digits, '/', ':', '.', '_' and '-', "
    "not starting with '/' or '.', with no '..' segment"
)
_ALLOWED = re.compile(r"[A-Za-z0-9/:._-]+")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9/:._-]")


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as a model name ("holds ' ', which a name may not"), or None."""
    if not name:
        return "is empty"
    if not _ALLOWED.fullmatch(name):
        bad = _NOT_ALLOWED.search(name)[0]  # type: ignore[index]  # fullmatch failed: one exists
        return f"holds {bad!r}, which a name may not"
    if len(name) > MAX_NAME_BYTES:  # ASCII only by now: one byte a character
        return (
            f"is {len(name)} characters long, more than the {MAX_NAME_BYTES} of a segment "
            "header's name field"
        )
    if name[0] in "/.":
        return f"starts with {name[0]!r}"
    if ".." in name.split("/"):
        return "has a '..' segment"
    return None
