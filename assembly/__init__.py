"""The top floor: the broker composed from the floors below it.

Every folder imports only from the floors beneath it (the contracts in
`[tool.importlinter]` of pyproject.toml): pipeline/ (0), config/ (1),
router/ (2), ingest/ and gpu/ (3), collector/ (4), api/ (5, the HTTP API),
this package, and above it the command line (run.py and cli/) and bench/
(docs/architecture.md, "Floors"). What names the stages of several floors at once lives here:

| module                 | what                                                         |
|------------------------|--------------------------------------------------------------|
| `assembly/stages.py`   | the stage table: which stage classes a broker runs           |
| `assembly/broker.py`   | the supervisor with its stages, rings and housekeeping        |
| `assembly/check.py`    | `run.py check`: the logs, jobs, vector stores and lost items  |
| `assembly/private_broker.py` | a broker a command starts for itself (the demo, `run.py batch`) |
| `assembly/fleet.py`    | a Ray fleet's rule of a turn: what to start, drain and remove  |
| `assembly/ray_fleet.py` | `run.py fleet`: workers as Ray actors (the one module importing Ray) |
"""
