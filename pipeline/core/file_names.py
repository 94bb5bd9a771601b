"""A name as a file name: the one encoding of every name that becomes a path or a file name.

Model names may hold '/' and ':' (pipeline/store/model_names.py), and they name
files: input segments (`in-<id>.<model>.s<shape>.l<lane>.seg`,
pipeline/store/segment_format.py) and vector stores (`vectors/<store>/`, a store
being named after its model by default, collector/vectors/store_catalog.py).
A '/' must never become a path separator, so each such name goes through
`file_safe` first:

| character                          | in the file name                         |
|------------------------------------|------------------------------------------|
| letters, digits, '.', '_', '-', '~' | itself                                  |
| any other (each byte of its UTF-8)  | `%XX`, upper-case hex (RFC 3986 percent-encoding) |

`file_safe("meta-llama/Llama-3.1-8B-Instruct")` is
`meta-llama%2FLlama-3.1-8B-Instruct`. Every name that was allowed before
'/' and ':' were (letters, digits, '.', '_' and '-') is its own file name,
so data dirs written then are read as they were. The encoding is one to one
('%' is itself encoded) and `from_file_safe` reverses it. The names "." and
".." (never a valid name, but this module does not rely on that) have their
dots encoded, so no encoded name is a path of its own.
"""

from __future__ import annotations

from urllib.parse import quote, unquote


def file_safe(name: str) -> str:
    """`name` as one file name: no '/', no NUL, never "." or ".."."""
    safe = quote(name, safe="")
    return safe.replace(".", "%2E") if safe in (".", "..") else safe


def from_file_safe(text: str) -> str:
    """The name that `file_safe` turned into `text`."""
    return unquote(text, errors="strict")
