"""The dispatch stage and what it is made of (docs/dispatch.md)."""
