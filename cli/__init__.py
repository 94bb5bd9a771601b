"""The command line: one module per command of `run.py` (the table of commands and the
dispatch; docs/operations.md), on the top floor beside bench/ (pyproject.toml's floors).

Each command's module adds its parser to run.py's (`add_parser`) and runs it (the handler it
sets); its heavy imports wait for the handler, so a short command starts fast.

| module                 | what                                                          |
|------------------------|---------------------------------------------------------------|
| `cli/serve.py`         | `run.py --config FILE`: the broker (assembly/broker.py)       |
| `cli/submit.py`        | `submit FILE.jsonl`: a file into a running broker             |
| `cli/results.py`       | `results JOB -o OUT`: a job's results, each once              |
| `cli/status.py`        | `status [JOB]`, `status --watch`: the broker, a job, a dashboard |
| `cli/cancel.py`        | `cancel JOB`                                                  |
| `cli/pause.py`         | `pause JOB` (and the control request `resume`, `priority` send) |
| `cli/resume.py`        | `resume JOB`                                                  |
| `cli/priority.py`      | `priority JOB N`                                              |
| `cli/vectors.py`       | `vectors stats|search|export`: the vector store               |
| `cli/worker.py`        | `worker`: a worker process of its own (a GPU host's)          |
| `cli/keys.py`          | `keys new NAME`: a CURVE key pair                             |
| `cli/check.py`         | `check [--fix]`: the data dir's offline check (assembly/check.py) |
| `cli/batch.py`         | `batch IN -o OUT`: one file through a private broker, resumably |
| `cli/batch_output.py`  | what `batch`'s OUT and errors file already hold: the resuming line, the first error |
| `cli/smollm2_dir.py`   | `smollm2-dir DIR`: SmolLM2 as a model directory for the vllm engine |
| `cli/demo.py`          | `demo`: the Python docs embedded with MiniLM, end to end      |
| `cli/common.py`        | what client commands share: options, address, CURVE keys      |
| `cli/progress_line.py` | the one progress line (`submit`, `results`, `batch`, `demo`, `vectors export`) |

A private broker (the demo's, `batch`'s) is assembly/private_broker.py.
"""
