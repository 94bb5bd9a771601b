"""Engines: what a worker runs a batch with (docs/engines.md).

| module          | what it holds                                                    |
|-----------------|------------------------------------------------------------------|
| `base`          | the contract every engine keeps, and the one out-of-memory rule |
| `registry`      | the engines by name (`make_engine`); above every engine module   |
| `echo`, `simulated` | engines for tests and benchmarks                             |
| `minilm`, `transformers`, `vllm` | the model engines                               |
| `generation`    | what the generation engines share (sampling, checks, packing)   |
| `pinned`        | model files checked by size and sha256                           |

This package imports nothing itself: import the module you need.
"""
