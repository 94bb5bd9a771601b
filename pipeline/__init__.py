"""The floor beneath everything: five rooms, each importing only from the rooms below it.

| room          | what                                                                         |
|---------------|------------------------------------------------------------------------------|
| `process/`    | stages, the supervisor, the fork server, heartbeats, start-up checks, banner |
| `telemetry/`  | the metrics catalogue, the supervisor's merged view, the scrape endpoint     |
| `store/`      | segment files, records, the data dir, `jobs/`, salvage, recovery, check      |
| `transport/`  | the wire, rings, ports and addresses, security, the client request loop      |
| `core/`       | ids, states, error codes, errors, ragged arrays, bitmaps                     |

process > telemetry > store | transport > core (the import-linter contract in pyproject.toml).
"""
