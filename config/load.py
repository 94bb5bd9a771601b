"""Loading settings: read TOML, lay it over the defaults, validate, freeze.

    defaults (config/defaults.py) <- file (TOML) <- overrides (dict)  -> validate() -> Settings

A section in the file or in `overrides` replaces only the keys it names; a
`models` list replaces the whole default list. Third-party errors (missing
file, unreadable file, TOML syntax) become one `ConfigError` naming the file.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from config.defaults import DEFAULTS
from config.settings import Settings, build_settings
from config.validate import validate
from pipeline.core.errors import ConfigError

__all__ = ["load_settings", "read_toml", "validate"]


def load_settings(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Return validated, frozen settings from `path` (None = defaults only) and `overrides`.

    `overrides` is shaped like the TOML file, e.g. `{"broker": {"data_dir": tmp_path}}`,
    and is applied on top of the file (paths may be Path objects, lists may be tuples). `Settings.data_path` is resolved against the
    current working directory now. Raises ConfigError (one message: file, dotted key,
    value, what is allowed) on any problem; never returns partial settings.
    """
    source = "<defaults>" if path is None else str(path)
    data = {} if path is None else read_toml(path)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(
            f"overrides = {overrides!r} is not a mapping; pass a dict shaped like the "
            'TOML file, e.g. {"broker": {"data_dir": "/tmp/fabric"}}'
        )
    overridden: set[str] = set()
    merged = _lay_over(copy.deepcopy(DEFAULTS), data, set())
    merged = _lay_over(merged, _plain(overrides or {}), overridden)
    validate(merged, source, overridden)
    return build_settings(merged, source=source, cwd=Path.cwd())


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse the TOML file at `path`; raise ConfigError if it is missing, unreadable or invalid."""
    example = "config/default.toml is an example to copy"
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such configuration file (looked for {Path(path).absolute()}); "
            f"check the path, or create it: {example}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read the configuration file ({exc.strerror}); "
            f"pass a readable file: {example}"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}{_quote_line(text, str(exc))}") from None


def _quote_line(text: str, message: str) -> str:
    """'; line 3 reads: ...' for the line tomllib's message points at, or ''."""
    match = re.search(r"at line (\d+)", message)
    if match is None:
        return "; fix the syntax near the end of the file"
    number = int(match[1])
    lines = text.splitlines()
    line = lines[number - 1].strip() if number <= len(lines) else ""
    return f"; line {number} reads: {line!r}; fix the syntax on that line"


def _plain(value: Any) -> Any:
    """Python-side conveniences in overrides, made TOML-shaped: paths -> str, tuples -> lists."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _lay_over(base: dict[str, Any], layer: Mapping[str, Any], marks: set[str]) -> dict[str, Any]:
    """Return `base` with `layer` applied, recording each dotted key it set in `marks`.

    Tables merge key by key; anything else (the `models` list, a value of the
    wrong type, an unknown section) replaces what was there, for `validate` to judge.
    """
    merged = dict(base)
    for name, value in layer.items():
        current = merged.get(name)
        if name != "models" and isinstance(current, dict) and isinstance(value, Mapping):
            merged[name] = {**current, **value}
            marks.update(f"{name}.{key}" for key in value)
        else:
            merged[name] = value
            marks.add(name)
    return merged
