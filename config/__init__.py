"""Typed, frozen configuration: one defaults table, TOML files on top, validated at start-up.

    settings = load_settings("config/prod.toml")      # or load_settings(None) for defaults
    settings.broker.lane_for(300)                       # -> 512
    settings.model("minilm").endpoints                  # -> ("/v1/embeddings",)

See docs/configuration.md for every key.
"""

from config.load import load_settings
from config.settings import Settings
from pipeline.core.errors import ConfigError

__all__ = ["ConfigError", "Settings", "load_settings"]
