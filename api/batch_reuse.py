"""Result reuse over HTTP: a batch's metadata `fabric_reuse: "true"` asks for it (the job's
`--reuse`, docs/completion.md "Result reuse"), and the Batch object's metadata then carries
`fabric_reused`: how many of its lines took the stored result of an identical earlier
request, as a string (OpenAI's metadata values are strings), kept up to date by the driver."""

from __future__ import annotations

from api.errors import invalid

REUSE_KEY = "fabric_reuse"  # metadata extension: "true" asks for result reuse
REUSED_KEY = "fabric_reused"  # metadata extension the Batch object shows: lines reused


def reuse_of(metadata: dict[str, str] | None) -> bool:
    """Whether a create's metadata asks for reuse; a 400 naming the value when it is neither
    "true" nor "false"."""
    text = (metadata or {}).get(REUSE_KEY)
    if text is None or text == "false":
        return False
    if text == "true":
        return True
    raise invalid(
        f'metadata {REUSE_KEY} {text!r} is not "true" or "false": send "true" to reuse the '
        "stored results of identical earlier requests",
        param="metadata",
    )


def with_reused(metadata: dict[str, str] | None, info: dict) -> dict[str, str] | None:
    """The metadata with `fabric_reused` from JOB_INFO's `reused` (unchanged without reuse)."""
    reused = info.get("reused")
    if reused is None or not reuse_of(metadata):
        return metadata
    return {**(metadata or {}), REUSED_KEY: str(int(reused))}
