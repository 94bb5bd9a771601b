"""Transport: the wire, shared-memory rings, ports and addresses, CURVE security, the one client request loop. Imports only core.

Rooms of pipeline/ (docs/architecture.md, "Floors"): process > telemetry > store | transport > core,
kept by the import-linter contract in pyproject.toml.

| module               | what |
|----------------------|------|
| `binds.py`           | Every port a broker listens on, in one table, and the one reading of an address |
| `broker_client.py`   | One client connection to a broker stage: its socket, its one request/retry loop, its backoff |
| `first_contact.py`   | A client's first contact with a broker: say where it waits, and fail fast when nothing listens |
| `outlet.py`          | A stage's way out: rings to each instance of the next stage, plus a wakeup socket each |
| `ports.py`           | Free loopback ports for a generated config (the demo, `run.py batch`, the tests and the |
| `reconnect_watch.py` | A client hears that its connection to a broker stage was lost and is back |
| `ring.py`            | A bounded single-producer single-consumer byte ring in POSIX shared memory |
| `ring_layout.py`     | A ring record's payload: its arrays at 8-byte aligned offsets, read back as zero-copy views |
| `ring_names.py`      | A ring's portable POSIX shared-memory name, from the data dir, the two stages and a number |
| `ring_port.py`       | A stage's end of a ring that follows the supervisor's replacements |
| `ring_records.py`    | The ingest ring records (ITEMS, KEYED): what flows front/tokenizer -> router -> writer |
| `security.py`        | CURVE authentication of the broker's ZeroMQ ports, and which binds may face the network |
| `topology.py`        | The stage processes a broker runs, the rings between them, and their internal sockets |
| `wire/`              | the wire protocol: message framing, limits, the inbox read loop, socket set-up |
| `zap_gate.py`        | The ZAP authenticator thread of a CURVE server (pipeline/transport/security.py `ServerGate`) |
"""
