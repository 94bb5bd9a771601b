"""The top floor: the broker composed from the floors below it.

Every folder imports only from the floors beneath it (the contracts in
`[tool.importlinter]` of pyproject.toml): pipeline/ (0), config/ (1),
router/ (2), ingest/ and gpu/ (3), collector/ (4), api/ (5, the HTTP API),
and on top this package, run.py and bench/ (docs/architecture.md, "Floors"). What names the stages of several floors at once lives here:

| module                 | what                                                         |
|------------------------|--------------------------------------------------------------|
| `assembly/stages.py`   | the stage table: which stage classes a broker runs           |
| `assembly/broker.py`   | the supervisor with its stages, rings and housekeeping        |
| `assembly/check.py`    | `run.py check`: the logs, jobs, vector stores and lost items  |
| `assembly/demo.py`     | `run.py demo`                                                |
"""
