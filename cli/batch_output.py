"""What `run.py batch`'s OUT and its errors file already hold, as the command says it: the
resuming line of a rerun, and the first error of a file whose every line failed."""

from __future__ import annotations

from pathlib import Path


def lines_in(path: Path, nonblank: bool = False) -> int:
    """Whole lines in `path` (0 when it does not exist); `nonblank`: only those with text."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        if nonblank:
            return sum(1 for line in f if line.strip())
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def resuming_line(input_path: Path, output: Path, errors_path: Path) -> str:
    """`resuming: 1,488 of 2,018 lines already in OUT (...)`: what an earlier run wrote."""
    results, errors = lines_in(output), lines_in(errors_path)
    return (
        f"resuming: {results + errors:,} of {lines_in(input_path, nonblank=True):,} lines "
        f"already in {output} ({results:,} results) and {errors_path.name} ({errors:,} errors)"
    )


def first_error(errors: Path) -> str:
    """`see ERRORS (the first says: ...)`: why the lines failed, from the errors file."""
    import orjson

    try:
        with open(errors, "rb") as f:
            first = orjson.loads(f.readline())
        message = (first.get("error") or {}).get("message") or first["response"]["body"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"see {errors}"
    return f"see {errors} (the first says: {str(message)[:300]})"
