"""The core vocabulary: names, ids, states and arrays every floor shares. Imports nothing else of pipeline/.

Rooms of pipeline/ (docs/architecture.md, "Floors"): process > telemetry > store | transport > core,
kept by the import-linter contract in pyproject.toml.

| module                | what |
|-----------------------|------|
| `errors.py`           | One root exception for the whole broker, with a family per subsystem |
| `exitcodes.py`        | Exit codes of `python run.py`, documented in docs/operations.md: the one table of them |
| `file_names.py`       | A name as a file name: the one encoding of every name that becomes a path or a file name |
| `idle_wait.py`        | How long an idle stage loop may wait for a wakeup before it looks at its rings itself |
| `index_bitmap.py`     | A set of item indexes kept as a bitmap: one bool per index, grown by doubling |
| `invocation.py`       | How a person runs this program again: the command that printed hints should start with |
| `item_error_codes.py` | The codes of item error results: the one list of what an error line's `error.code` says |
| `item_seq.py`         | An item's seq: the one number that names an item everywhere, `(job_no << 32) + index` |
| `job_states.py`       | A job's states: the one list of what `status`, the results clients and the sinks may see |
| `line_table.py`       | A job's fan-out lines: which items are the parts of which line, and lines counted from items |
| `ragged.py`           | Ragged arrays: n variable-length rows stored back to back, and the one offsets rule |
| `result_kinds.py`     | What a stored or sent result is: its status (a result or an error) and its payload kind |
| `token_logprobs.py`   | The payload of a `TOKEN_LOGPROBS` result: generated tokens with their log probabilities |
| `wake_pipe.py`        | A pipe that wakes a wait on file descriptors: its `fd` turns readable at `wake()` |
"""
