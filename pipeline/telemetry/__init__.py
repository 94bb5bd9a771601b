"""Telemetry: the catalogue of metrics, the supervisor's merged view of them, and the scrape endpoint. Imports core, store and transport.

Rooms of pipeline/ (docs/architecture.md, "Floors"): process > telemetry > store | transport > core,
kept by the import-linter contract in pyproject.toml.

| module              | what |
|---------------------|------|
| `metric_catalogue.py` | The catalogue of every metric the broker exposes (`METRICS`) |
| `metrics.py`        | How a stage reports its own figures (Histogram, STATS samples, StatsPusher) |
| `metrics_hub.py`    | The supervisor's view of every stage's statistics: the latest report of each, merged |
| `metrics_server.py` | The supervisor's metrics thread: stage reports in over ZeroMQ, Prometheus text out over HTTP |
"""
